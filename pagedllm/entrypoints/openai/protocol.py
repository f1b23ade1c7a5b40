"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, errors.

Requests refuse fields this server does not implement (400 naming the field: a silently ignored
``tools`` or ``response_format`` would be a wrong answer, not an error); types are checked
strictly by pydantic (``true`` is not an integer, ``"1"`` is not a number; a mismatch becomes a
400, see api_server); every string must be valid text (a lone UTF-16 surrogate such as
``"\ud800"`` cannot be encoded, so it is refused, naming the field); value ranges are checked
by SamplingParams (one source of truth).
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer


def _now() -> int:
    return int(time.time())


# ---- errors ----------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- shared pieces ---------------------------------------------------------------------------
def _check_text(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"is not valid text: character {e.start} is a lone UTF-16 surrogate "
                             "(\\ud800-\\udfff), which no UTF-8 text can hold") from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_text(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k)
            _check_text(v)


class _Request(BaseModel):
    # allow_inf_nan=False: NaN / Infinity (which Python's JSON reader accepts) are refused, naming the field
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        _check_text(value)
        return value


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) on every chunk


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaFormat] = None
    # type structural_tag (vLLM's): begin / schema / end structures and their triggers, or xgrammar's format
    structures: Optional[list[dict[str, Any]]] = None
    triggers: Optional[list[str]] = None
    format: Optional[dict[str, Any]] = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: Optional[list[int]] = None
    # beam search (vLLM's extras; entrypoints/openai/beam.py): n is the beam width
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    # seconds until the request is aborted (default: the server's --request-timeout, if set)
    timeout: Optional[float] = Field(default=None, gt=0)
    # structured outputs (entrypoints/openai/structured.py): OpenAI's response_format, vLLM's extras
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # OpenAI billing / storage fields: accepted and ignored (docs/usage.md lists them)
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    # vLLM's request extensions (docs/usage.md, *vLLM's request extensions*)
    bad_words: Optional[list[str]] = None
    allowed_token_ids: Optional[list[int]] = None
    truncate_prompt_tokens: Optional[int] = None  # keep the prompt's last N tokens (-1: max_model_len - 1)
    return_token_ids: Optional[bool] = None
    spaces_between_special_tokens: bool = True
    cache_salt: Optional[str] = Field(default=None, min_length=1)
    request_id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    priority: int = 0  # lower runs first under --scheduling-policy priority
    vllm_xargs: Optional[dict[str, Any]] = None  # SamplingParams.extra_args: read by --logits-processors
    # kv_transfer_params: accepted and ignored, as vLLM ignores it without a KV connector;
    # mm_processor_kwargs: ignored by a text-only model as in vLLM, refused (non-empty) by an image model
    kv_transfer_params: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None


# ---- /v1/completions -------------------------------------------------------------------------
PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    prompt_logprobs: Optional[int] = None  # vLLM: logprobs of the prompt's tokens (top-N besides each)
    add_special_tokens: bool = True  # vLLM: the tokenizer's special tokens (BOS) around a text prompt


class CompletionLogprobs(BaseModel):
    """The legacy (completions) logprobs format."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class LogprobInfo(BaseModel):
    """vLLM's Logprob, as its prompt_logprobs carry them ({token id: LogprobInfo} per position)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


PromptLogprobsOut = list[Optional[dict[int, LogprobInfo]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobsOut] = None  # vLLM extra (not streamed)
    prompt_token_ids: Optional[list[int]] = None  # vLLM: with return_token_ids
    token_ids: Optional[list[int]] = None

    @model_serializer(mode="wrap")
    def _drop_token_ids(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k not in ("prompt_token_ids", "token_ids")}


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class CompletionStreamResponse(CompletionResponse):
    pass


# ---- /v1/chat/completions --------------------------------------------------------------------
class ImageURL(_Request):
    url: str  # a data: URL (base64), a local file under --allowed-local-media-path, http(s) from --allowed-media-domains
    detail: Optional[str] = None  # OpenAI's; accepted, no effect


class ContentPart(_Request):
    type: str
    text: Optional[str] = None
    image_url: Optional[Union[ImageURL, str]] = None  # type "image_url" (a multimodal model)


class FunctionCallIn(_Request):
    name: str
    arguments: str


class ToolCallIn(_Request):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Request):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant's earlier tool calls
    tool_call_id: Optional[str] = None  # role "tool": the call this message answers


class FunctionDef(_Request):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
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


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: Optional[str] = None  # vLLM: with --reasoning-parser

    @model_serializer(mode="wrap")
    def _drop_reasoning(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k != "reasoning_content"}


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None  # vLLM: with return_token_ids

    @model_serializer(mode="wrap")
    def _drop_token_ids(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k != "token_ids"}


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None
    prompt_logprobs: Optional[PromptLogprobsOut] = None  # vLLM extra, on the response (not streamed)
    prompt_token_ids: Optional[list[int]] = None  # vLLM: with return_token_ids

    @model_serializer(mode="wrap")
    def _drop_token_ids(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k != "prompt_token_ids"}


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # vLLM: with --reasoning-parser
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None  # vLLM: with return_token_ids

    @model_serializer(mode="wrap")
    def _drop_token_ids(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k != "token_ids"}


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None  # vLLM: with return_token_ids, on the first chunk

    @model_serializer(mode="wrap")
    def _drop_token_ids(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k != "prompt_token_ids"}


_json_string = json.encoder.encode_basestring  # (C) escapes as pydantic does, non-ASCII kept


def _json(value) -> str:
    """A str, int or None as JSON, quickly (the stream templates' values)."""
    if value is None:
        return "null"
    return _json_string(value) if isinstance(value, str) else json.dumps(value)


class _StreamChunks:
    """The SSE events of one stream. The usual chunk (one choice's new text; no logprobs, token
    ids or usage) is a template around its JSON-escaped text, byte for byte what the response
    model's ``model_dump_json()`` gives (tests/entrypoints/test_stream_chunks.py pins it),
    without building pydantic models per token; other chunks are built from the models
    (``model_chunk``). Every chunk of the stream has the same ``created``, as OpenAI's do."""

    OBJECT: str
    RESPONSE: type

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model, self.created = rid, model, _now()
        self._head = (f'data: {{"id":{_json(rid)},"object":"{self.OBJECT}","created":{self.created},'
                      f'"model":{_json(model)},"choices":[{{"index":')

    @staticmethod
    def _tail(finish_reason: Optional[str], stop_reason) -> str:
        return f'"logprobs":null,"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}'

    def model_chunk(self, choices: list, usage: Optional[UsageInfo] = None, **extra) -> str:
        response = self.RESPONSE(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage,
                                 **extra)
        return f"data: {response.model_dump_json()}\n\n"


class CompletionChunks(_StreamChunks):
    OBJECT, RESPONSE = "text_completion", CompletionStreamResponse

    def text(self, index: int, text: str, finish_reason: Optional[str], stop_reason) -> str:
        return (f'{self._head}{index},"text":{_json(text)},{self._tail(finish_reason, stop_reason)},'
                f'"prompt_logprobs":null}}],"usage":null}}\n\n')


class ChatChunks(_StreamChunks):
    OBJECT, RESPONSE = "chat.completion.chunk", ChatCompletionStreamResponse

    def content(self, index: int, text: str, finish_reason: Optional[str], stop_reason) -> str:
        return (f'{self._head}{index},"delta":{{"content":{_json(text)}}},{self._tail(finish_reason, stop_reason)}}}],'
                f'"usage":null}}\n\n')


# ---- models, tokenizer, misc -----------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedllm"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
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


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_path: Optional[str] = None  # accepted (vLLM's body) and not needed: the name identifies it


class VersionResponse(BaseModel):
    version: str
