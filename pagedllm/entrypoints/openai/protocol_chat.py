"""Pydantic models of /v1/chat/completions: the request (messages, content parts, tools), the
reply (messages, tool calls, chat logprobs) and the streamed deltas."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol_base import OmitNone, RequestModel, ResponseHead, SamplingFields
from pagedllm.entrypoints.openai.protocol_completions import PromptLogprobsOut


# ---- the request -----------------------------------------------------------------------------
class ImageURL(RequestModel):
    url: str  # a data: URL (base64), a local file under --allowed-local-media-path, http(s) from --allowed-media-domains
    detail: Optional[str] = None  # OpenAI's; accepted, no effect


class ContentPart(RequestModel):
    type: str
    text: Optional[str] = None
    image_url: Optional[Union[ImageURL, str]] = None  # type "image_url" (a multimodal model)


class FunctionCallIn(RequestModel):
    name: str
    arguments: str


class ToolCallIn(RequestModel):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(RequestModel):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant's earlier tool calls
    tool_call_id: Optional[str] = None  # role "tool": the call this message answers


class FunctionDef(RequestModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDef(RequestModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra variables for the chat template
    prompt_logprobs: Optional[int] = None  # vLLM: logprobs of the prompt's tokens (top-N besides each)
    # tool calling (entrypoints/openai/tool_calls.py)
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    # vLLM's chat extensions
    continue_final_message: bool = False  # the final (assistant) message is continued, not closed
    echo: bool = False  # the reply starts with the final message's content (with continue_final_message)
    add_special_tokens: bool = False  # the tokenizer's special tokens on top of the chat template's
    documents: Optional[list[dict[str, str]]] = None  # the chat template's documents (RAG templates)


# ---- the reply -------------------------------------------------------------------------------
class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatLogprobToken]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OmitNone):
    OMIT_NONE = frozenset({"reasoning_content"})

    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: Optional[str] = None  # vLLM: with --reasoning-parser


class DeltaFunctionCall(OmitNone):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(OmitNone):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(OmitNone):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # vLLM: with --reasoning-parser
    tool_calls: Optional[list[DeltaToolCall]] = None


_TOKEN_IDS = frozenset({"token_ids"})
_PROMPT_TOKEN_IDS = frozenset({"prompt_token_ids"})


class ChatChoice(OmitNone):
    OMIT_NONE = _TOKEN_IDS

    index: int
    message: ChatMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None  # vLLM: with return_token_ids


class ChatStreamChoice(OmitNone):
    OMIT_NONE = _TOKEN_IDS

    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None  # vLLM: with return_token_ids


class ChatCompletionResponse(OmitNone, ResponseHead):
    OMIT_NONE = _PROMPT_TOKEN_IDS

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: Optional[PromptLogprobsOut] = None  # vLLM extra, on the response (not streamed)
    prompt_token_ids: Optional[list[int]] = None  # vLLM: with return_token_ids


class ChatCompletionStreamResponse(OmitNone, ResponseHead):
    OMIT_NONE = _PROMPT_TOKEN_IDS

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    prompt_token_ids: Optional[list[int]] = None  # vLLM: with return_token_ids, on the first chunk
