"""Pydantic models of the Responses API (``/v1/responses``): the request, and the response object
and stream events as the openai SDK reads them (``openai.types.responses``).

As the chat and completion requests, a request refuses what this server does not implement
(400 naming the field): built-in tools (web search, file search, computer use, MCP), stored
prompts, conversations, ``include`` entries other than ``message.output_text.logprobs``,
``reasoning.summary``, ``truncation: "auto"``, ``max_tool_calls``. ``reasoning.effort`` goes to
the chat template as ``reasoning_effort`` (vLLM's rule); reasoning items come from
``--reasoning-parser``.
Input items are plain objects here and are checked item by item in responses.py, so an error
names ``input[i].field``.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol_base import RequestModel


class ResponsesFunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponsesNamedToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(RequestModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponsesText(RequestModel):
    format: Optional[ResponsesTextFormat] = None


class ResponsesReasoning(RequestModel):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None  # refused: no summaries here
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None  # its older name, refused too


class ResponsesStreamOptions(RequestModel):
    include_obfuscation: Optional[bool] = None  # accepted: this server never pads events (no obfuscation field)


class ResponsesRequest(RequestModel):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[ResponsesFunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ResponsesNamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[ResponsesText] = None
    previous_response_id: Optional[str] = None
    store: bool = True
    background: bool = False
    stream: bool = False
    stream_options: Optional[ResponsesStreamOptions] = None
    truncation: Optional[Literal["disabled"]] = None
    # include ["message.output_text.logprobs"]: output_text.logprobs, with top_logprobs alternatives
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    reasoning: Optional[ResponsesReasoning] = None
    # OpenAI billing / routing fields: accepted and ignored, as in chat completions (docs/usage.md)
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    # vLLM's extras on its Responses request
    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    request_id: Optional[str] = None


# ---- the response object ---------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The model's reasoning (``--reasoning-parser``): its text as a reasoning_text part, no summary."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Union[ReasoningItem, OutputMessage, FunctionCallItem]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: Optional[int] = None
    status: ResponseStatus = "in_progress"
    error: Optional[ResponseErrorInfo] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: Optional[int] = None
    reasoning: Optional[dict[str, Any]] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: Optional[str] = None
    usage: Optional[ResponseUsage] = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    has_more: bool = False
