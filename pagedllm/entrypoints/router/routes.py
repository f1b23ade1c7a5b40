"""The router's routes: completions and chat completions routed by prompt prefix, /tokenize,
/detokenize and /v1/models by load, and its own /health, /version and /metrics; 404 and 405
OpenAI-shaped (``http_error``). Handlers reach the RouterState as ``request.app.state.router``."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.router.metrics import CONTENT_TYPE
from pagedllm.entrypoints.router.state import RouterState, error_response

router = APIRouter()


async def current_router(request: Request) -> RouterState:
    """The app's RouterState (a FastAPI dependency of the route handlers)."""
    return request.app.state.router


async def http_error(request: Request, exc: StarletteHTTPException):  # 404, 405: OpenAI-shaped
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = {404: f"no such route: {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                      str(exc.detail))
    return error_response(exc.status_code, message, codes.get(exc.status_code, "error"), headers=exc.headers)


def _block_hashes(state: RouterState, path: str, body: bytes) -> list[bytes]:
    try:
        parsed: Any = json.loads(body)
    except (ValueError, RecursionError):  # the replica answers it with its 400
        return []
    return state.hasher.block_hashes(path, parsed) if isinstance(parsed, dict) else []


async def _routed(state: RouterState, raw: Request, path: str) -> Response:
    body = await raw.body()  # read (bounded) by RouterGuard
    hashes: list[bytes] = []
    if state.hasher is not None and state.replicas.policy != "round_robin":
        hashes = await asyncio.to_thread(_block_hashes, state, path, body)
    return await state.proxy(raw, path, body, hashes)


@router.post("/v1/completions")
async def completions(raw: Request, state: RouterState = Depends(current_router)):
    return await _routed(state, raw, "/v1/completions")


@router.post("/v1/chat/completions")
async def chat_completions(raw: Request, state: RouterState = Depends(current_router)):
    return await _routed(state, raw, "/v1/chat/completions")


@router.post("/tokenize")
async def tokenize(raw: Request, state: RouterState = Depends(current_router)):
    return await state.proxy(raw, "/tokenize", await raw.body(), [], count=False)


@router.post("/detokenize")
async def detokenize(raw: Request, state: RouterState = Depends(current_router)):
    return await state.proxy(raw, "/detokenize", await raw.body(), [], count=False)


@router.get("/v1/models")
async def models(raw: Request, state: RouterState = Depends(current_router)):
    return await state.proxy(raw, "/v1/models", b"", [], count=False)


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(state: RouterState = Depends(current_router)):
    up = state.replicas.healthy()
    if up:
        return Response(status_code=200)
    return error_response(503, "no replica is healthy: " + "; ".join(f"replica {r.id} ({r.url}): {r.last_error}"
                                                                     for r in state.replicas.replicas), "no_replica")


@router.get("/version")
async def version():
    from pagedllm.version import __version__

    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def metrics(state: RouterState = Depends(current_router)):
    return Response(content=await state.gather_metrics(), media_type=CONTENT_TYPE)
