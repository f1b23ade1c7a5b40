"""The pooling routes' handlers over a PoolingEngine (engine/pooling_engine.py): inputs validated
and tokenized, the engine's forward run off the event loop (one at a time: the engine batches a
request's inputs into as few forwards as its budgets allow), vLLM-shaped responses."""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Optional

import numpy as np
import torch

from pagedllm.entrypoints.openai.pooling_protocol import (
    EmbeddingData, EmbeddingRequest, EmbeddingResponse, PoolingData, PoolingRequest, PoolingResponse, RerankDocument,
    RerankRequest, RerankResponse, RerankResult, RerankUsage, ScoreData, ScoreRequest, ScoreResponse)
from pagedllm.entrypoints.openai.protocol import UsageInfo
from pagedllm.entrypoints.openai.serving import APIError


def _encode(vec: torch.Tensor, fmt: str):
    """float: a JSON list; base64: the little-endian float32 bytes (what the openai client decodes)."""
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(vec.float().numpy(), dtype="<f4").tobytes()).decode("ascii")
    return vec.float().tolist()


def _usage(tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=tokens, total_tokens=tokens)


class PoolingServing:
    def __init__(self, engine, served_model_names: list[str]) -> None:
        self.engine = engine
        self.names = served_model_names
        self.max_model_len = engine.max_model_len

    def _model(self, requested: Optional[str]) -> str:
        if requested is not None and requested not in self.names:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {self.names[0]!r}",
                           "model", "model_not_found")
        return self.names[0]

    async def _call(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    def _truncation(self, req) -> Optional[int]:
        try:
            return self.engine.truncation(req.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), "truncate_prompt_tokens", "invalid_value") from None

    def _inputs(self, value, truncate: Optional[int] = None) -> list[list[int]]:
        if isinstance(value, str):
            items = [value]
        elif value and all(isinstance(t, int) for t in value):
            items = [value]
        else:
            items = list(value)
        if not items:
            raise APIError(400, "input must not be empty", "input", "invalid_value")
        try:
            return [self.engine.tokenize(p, "input", truncate) for p in items]
        except ValueError as e:
            raise APIError(400, str(e), "input", "invalid_value") from None

    def _check_task(self, task: str, route: str) -> None:
        if task not in self.engine.supported_tasks:
            raise APIError(400, f"{route}: this model ({self.engine.runner.arch}) does not support {task!r}; it "
                           f"supports {', '.join(self.engine.supported_tasks)}", code="unsupported_task")

    async def create_embedding(self, req: EmbeddingRequest) -> EmbeddingResponse:
        model = self._model(req.model)
        self._check_task("embed", "/v1/embeddings")
        seqs = self._inputs(req.input, self._truncation(req))
        vecs = await self._call(self.engine.embed, seqs, req.dimensions)
        data = [EmbeddingData(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(vecs)]
        return EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", created=int(time.time()), model=model, data=data,
                                 usage=_usage(sum(map(len, seqs))))

    async def create_pooling(self, req: PoolingRequest) -> PoolingResponse:
        model = self._model(req.model)
        task = req.task or ("classify" if self.engine.is_cross_encoder else "embed")
        self._check_task(task, "/pooling")
        if req.dimensions is not None and task != "embed":
            raise APIError(400, "dimensions applies to task 'embed' only", "dimensions", "invalid_value")
        seqs = self._inputs(req.input, self._truncation(req))
        if task == "embed":
            out = await self._call(self.engine.embed, seqs, req.dimensions)
        elif task == "token_embed":
            out = await self._call(self.engine.token_embed, seqs)
        else:
            out = list(await self._call(self.engine.classify, seqs))
        data = [PoolingData(index=i, data=_encode(t, req.encoding_format)) for i, t in enumerate(out)]
        return PoolingResponse(id=f"pool-{uuid.uuid4().hex}", created=int(time.time()), model=model, data=data,
                               usage=_usage(sum(map(len, seqs))))

    async def create_score(self, req: ScoreRequest) -> ScoreResponse:
        model = self._model(req.model)
        self._check_task("score", "/score")
        a = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        b = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if not a or not b:
            raise APIError(400, "text_1 and text_2 must not be empty", "text_1", "invalid_value")
        scores, tokens = await self._call(self.engine.score, a, b, self._truncation(req))
        return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)], usage=_usage(tokens))

    async def create_rerank(self, req: RerankRequest) -> RerankResponse:
        model = self._model(req.model)
        self._check_task("score", "/rerank")
        if not req.documents:
            raise APIError(400, "documents must not be empty", "documents", "invalid_value")
        scores, tokens = await self._call(self.engine.score, [req.query], req.documents, self._truncation(req))
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order]
        return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, usage=RerankUsage(total_tokens=tokens),
                              results=results)
