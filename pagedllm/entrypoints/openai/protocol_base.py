"""The pieces every OpenAI-compatible model shares: errors, the strict request base, usage, the
sampling fields of completions and chat, and the serializer that leaves out unset vLLM extras.

Requests refuse fields this server does not implement (400 naming the field: a silently ignored
``tools`` or ``response_format`` would be a wrong answer, not an error); types are checked
strictly by pydantic (``true`` is not an integer, ``"1"`` is not a number; a mismatch becomes a
400, see api_server); every string must be valid text (a lone UTF-16 surrogate such as
``"\\ud800"`` cannot be encoded, so it is refused, naming the field); value ranges are checked
by SamplingParams (one source of truth).
"""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer


def unix_now() -> int:
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
def check_text(value: Any) -> None:
    """Refuse a string (anywhere in ``value``) that UTF-8 cannot hold: a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"is not valid text: character {e.start} is a lone UTF-16 surrogate "
                             "(\\ud800-\\udfff), which no UTF-8 text can hold") from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_text(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k)
            check_text(v)


class RequestModel(BaseModel):
    """A request body: unknown fields refused, types strict, every string valid text."""

    # allow_inf_nan=False: NaN / Infinity (which Python's JSON reader accepts) are refused, naming the field
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        check_text(value)
        return value


class OmitNone(BaseModel):
    """A response model whose fields named in ``OMIT_NONE`` (every field when it is None) are
    left out of the JSON while unset: vLLM's extras appear only when asked for."""

    OMIT_NONE: ClassVar[Optional[frozenset[str]]] = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler) -> dict[str, Any]:
        omit = self.OMIT_NONE
        return {k: v for k, v in handler(self).items() if v is not None or (omit is not None and k not in omit)}


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) on every chunk


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(RequestModel):
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


class ResponseHead(BaseModel):
    """The fields that open a completion, chat completion or stream chunk (each subclass names
    its ``object`` and its ``choices``' type)."""

    id: str
    object: str
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[Any]
    usage: Optional[UsageInfo] = None


class SamplingFields(RequestModel):
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
