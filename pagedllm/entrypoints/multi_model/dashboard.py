"""/dashboard of a multi-model server (``--enable-dashboard``): a page of its models (state,
memory, requests in flight and waiting, loads and unloads), and each loaded model's own live page
at /models/NAME/dashboard (passed through to that model's server). Behind --api-key as the API
(a browser gives the key as the password); the same security headers as a single server's page."""
from __future__ import annotations

import os
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from pagedllm.entrypoints.multi_model.manager import ModelState
from pagedllm.entrypoints.openai.dashboard import PAGE_HEADERS, STATIC_DIR
from pagedllm.entrypoints.relay import error_response, relay, request_headers

STATIC_FILES = {"models.js": "text/javascript", "dashboard.css": "text/css"}
router = APIRouter()


async def _front(request: Request):
    return request.app.state.front


def _read(name: str) -> bytes:
    with open(os.path.join(STATIC_DIR, name), "rb") as f:
        return f.read()


def models_snapshot(manager) -> dict:
    runtime = manager.runtime_bytes
    return {"time": time.time(), "memory_budget_bytes": manager.settings.memory_budget,
            "memory_bytes": manager.measured_total(), "memory_peak_bytes": manager.peak_total,
            "models": [{"name": m.name, "names": list(m.entry.names), "path": m.entry.path, "state": m.state.value,
                        "pinned": m.entry.pinned, "memory_bytes": m.memory_bytes,
                        "footprint_bytes": m.footprint(runtime), "in_flight": m.in_flight, "waiting": m.waiting,
                        "loads": m.loads, "load_failures": m.load_failures, "unloads": dict(m.unloads),
                        "last_load_seconds": m.load_seconds[-1] if m.load_seconds else None, "error": m.error,
                        "dashboard": True} for m in manager.models.values()]}


@router.get("/dashboard")
async def models_page():
    return HTMLResponse(_read("models.html"), headers=PAGE_HEADERS)


@router.get("/dashboard/static/{name}")
async def models_static(name: str):
    if name not in STATIC_FILES:
        return error_response(404, f"no such dashboard file: {name!r}", "not_found")
    return Response(_read(name), media_type=STATIC_FILES[name], headers=PAGE_HEADERS)


@router.get("/dashboard/api/models")
async def models_state(state=Depends(_front)):
    return JSONResponse(models_snapshot(state.manager))


@router.get("/models/{name}/dashboard{rest:path}")
async def model_dashboard(name: str, rest: str, raw: Request, state=Depends(_front)):
    """A loaded model's own live page; not counted as a request in flight (an open page never keeps
    a model from being unloaded: its event stream just ends)."""
    m = state.manager.models.get(name)
    if m is None or m.state is not ModelState.LOADED or m.url is None:
        return error_response(404, f"the model `{name}` is not loaded: its live page exists while it is",
                              "not_loaded")
    req = state.client.build_request("GET", f"{m.url}/dashboard{rest}", headers=request_headers(raw),
                                     params=raw.query_params)
    resp = await state.client.send(req, stream=True)

    async def broke(e: Exception, mid_stream: bool) -> tuple[int, str, str]:
        return 502, f"the server of model `{name}` went away", "model_server_failed"

    return await relay(resp, {}, lambda: None, broke)
