"""Request and response bodies of the pooling routes, in vLLM's shapes: /v1/embeddings (OpenAI),
/pooling, /classify, /score, /rerank and /v1/rerank (Jina / Cohere). Unknown fields are refused (400)."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol_base import RequestModel, UsageInfo

# a string, strings, token ids, or lists of token ids
EmbeddingInput = Union[str, list[str], list[int], list[list[int]]]


class EmbeddingRequest(RequestModel):
    input: EmbeddingInput
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: at most N tokens per input (-1: max_model_len)


class PoolingRequest(RequestModel):
    input: EmbeddingInput
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    task: Optional[Literal["embed", "token_embed", "classify"]] = None
    dimensions: Optional[int] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: at most N tokens per input (-1: max_model_len)


class ClassificationRequest(RequestModel):
    """vLLM's /classify: a sequence classifier's label probabilities for each input."""
    input: EmbeddingInput
    model: Optional[str] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: at most N tokens per input (-1: max_model_len)


class ScoreRequest(RequestModel):
    """vLLM's /score: one query against several documents, or pairwise lists, as text_1 / text_2
    or (vLLM 0.32's spelling) queries / documents -- one spelling, both of its fields."""
    text_1: Optional[Union[str, list[str]]] = None
    text_2: Optional[Union[str, list[str]]] = None
    queries: Optional[Union[str, list[str]]] = None
    documents: Optional[Union[str, list[str]]] = None
    model: Optional[str] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None


class RerankRequest(RequestModel):
    query: str
    documents: list[str]
    model: Optional[str] = None
    top_n: Optional[int] = Field(default=None, ge=0)
    return_documents: bool = True
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None


class EmbeddingData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: Union[list[float], str]


class EmbeddingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(BaseModel):
    index: int
    object: str = "pooling"
    data: Union[list[float], list[list[float]], str]


class PoolingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: UsageInfo


class ClassificationData(BaseModel):
    index: int
    label: Optional[str]  # the id2label name of the most probable class
    probs: list[float]  # softmax over the labels; a one-label head: [sigmoid of its logit]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: Optional[RerankDocument] = None
    relevance_score: float


class RerankUsage(BaseModel):
    """vLLM's rerank usage: the tokens of every (query, document) pair run, in both fields."""
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
