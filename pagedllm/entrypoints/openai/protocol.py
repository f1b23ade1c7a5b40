"""Pydantic models of the OpenAI-compatible API, by API: protocol_base (errors, the strict request
base, usage, the shared sampling fields), protocol_completions, protocol_chat, protocol_chunks
(the stream chunks) and, here, the models list, /tokenize, /detokenize, LoRA loading and
/version. Every name stays importable from this module.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol_base import (  # noqa: F401  (re-exported)
    ErrorInfo, ErrorResponse, JsonSchemaFormat, OmitNone, PromptTokensDetails, RequestModel, ResponseFormat,
    ResponseHead, SamplingFields, StreamOptions, UsageInfo, check_text, unix_now,
)
from pagedllm.entrypoints.openai.protocol_chat import (  # noqa: F401  (re-exported)
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse, ChatLogprobs,
    ChatLogprobToken, ChatMessage, ChatMessageIn, ChatStreamChoice, ChatTopLogprob, ContentPart, DeltaFunctionCall,
    DeltaMessage, DeltaToolCall, FunctionCall, FunctionCallIn, FunctionDef, ImageURL, NamedFunction, NamedToolChoice,
    ToolCall, ToolCallIn, ToolDef,
)
from pagedllm.entrypoints.openai.protocol_chunks import ChatChunks, CompletionChunks, StreamChunks  # noqa: F401
from pagedllm.entrypoints.openai.protocol_completions import (  # noqa: F401  (re-exported)
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, CompletionStreamResponse,
    LogprobInfo, PromptInput, PromptLogprobsOut,
)


# ---- models, tokenizer, misc -----------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "pagedllm"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessageIn]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_path: Optional[str] = None  # accepted (vLLM's body) and not needed: the name identifies it


class VersionResponse(BaseModel):
    version: str
