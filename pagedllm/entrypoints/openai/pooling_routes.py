"""The pooling routes (/v1/embeddings, /pooling, /classify, /score, /rerank and /v1/rerank) on the app; they
answer when the server runs a pooling model (``--runner pooling`` or an encoder architecture).
The handlers (serving_pooling.PoolingServing) return the responses, their JSON built off the
event loop."""
from __future__ import annotations

from fastapi import FastAPI

from pagedllm.entrypoints.openai.pooling_protocol import (
    ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest)


def add_pooling_routes(app: FastAPI, state) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest):
        return await state.require_pooling().create_embedding(req)

    @app.post("/pooling")
    async def pooling(req: PoolingRequest):
        return await state.require_pooling().create_pooling(req)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(req: ClassificationRequest):
        return await state.require_pooling().create_classify(req)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(req: ScoreRequest):
        return await state.require_pooling().create_score(req)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(req: RerankRequest):
        return await state.require_pooling().create_rerank(req)
