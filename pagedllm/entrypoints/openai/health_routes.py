"""The operator's routes: /health and /ping (200 once the engine serves, else the 503 saying why),
/version, and /metrics (Prometheus text; ``metrics_router``, the app's last routes)."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from pagedllm.entrypoints.openai.body_parsing import OffLoopBodyRoute
from pagedllm.entrypoints.openai.middleware import json_response
from pagedllm.entrypoints.openai.protocol import VersionResponse
from pagedllm.entrypoints.openai.server_state import ServerState, current_server
from pagedllm.version import __version__

router = APIRouter(route_class=OffLoopBodyRoute)
metrics_router = APIRouter(route_class=OffLoopBodyRoute)


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(state: ServerState = Depends(current_server)):
    state.require_up()
    return Response(status_code=200)


@router.api_route("/ping", methods=["GET", "HEAD"])
async def ping(state: ServerState = Depends(current_server)):
    state.require_up()
    return Response(status_code=200)


@router.get("/version")
async def version():
    return json_response(VersionResponse(version=__version__))


@metrics_router.get("/metrics")
async def metrics(state: ServerState = Depends(current_server)):
    dead = state.load_error is not None or (state.engine is not None and not state.engine.is_running)
    body, content_type = state.metrics.render(state.engine.stats if state.engine is not None else None,
                                              engine_dead=dead)
    return Response(content=body, media_type=content_type)
