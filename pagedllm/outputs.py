"""Public, vLLM-shaped results."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# One generated position's logprobs: token id -> Logprob, sampled token first.


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


# ---- the pooling runner's results (LLM.embed / score / encode / classify) ----


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class PoolingOutput:
    data: "torch.Tensor"


@dataclass
class PoolingRequestOutput:
    """One input's result; ``outputs`` one of the output types above."""

    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    finished: bool = True
