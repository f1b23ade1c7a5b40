"""Pydantic models of /v1/completions: the request, its choices (whole and streamed), the legacy
logprobs format and vLLM's prompt_logprobs."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol_base import OmitNone, ResponseHead, SamplingFields

PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
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


class CompletionChoice(OmitNone):
    OMIT_NONE = frozenset({"prompt_token_ids", "token_ids"})

    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobsOut] = None  # vLLM extra (not streamed)
    prompt_token_ids: Optional[list[int]] = None  # vLLM: with return_token_ids
    token_ids: Optional[list[int]] = None


class CompletionResponse(ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionStreamResponse(CompletionResponse):
    pass
