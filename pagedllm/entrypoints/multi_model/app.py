"""The multi-model server's HTTP front: the request's ``model`` picks the model, which is loaded
if it is not (the request waits, bounded by its deadline), and the request is passed to that
model's own server; its answer (a body, or a stream chunk by chunk) comes back unchanged.

Routes: every POST of a single server that names a model (completions, chat, responses,
embeddings, pooling, classify, score, rerank, tokenize, detokenize) is routed by its body's
``model``; a body without one goes to the only model when there is one, else 400. An unknown
model is 404 naming the available ones. /v1/responses/{id} (GET, DELETE, cancel, input_items)
asks the loaded models in turn (a stored response lives in the model server that made it).
/v1/models lists every servable model with its state; /health is 200 while this front is up
(models load on demand); /metrics has every loaded model's families (each carries its
``model_name``) and this front's own. Runtime LoRA loading is refused: give each model its
adapters in --models-config. The API key and the bounded body are checked first
(``http_guard.guard_body``), as on a single server.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.http_guard import guard_body
from pagedllm.entrypoints.multi_model.catalog import ModelEntry, resolve
from pagedllm.entrypoints.multi_model.manager import ModelManager, ModelState, ModelUnavailable, ServedModel
from pagedllm.entrypoints.relay import error_response, relay, request_headers, unless_disconnected, whole_response
from pagedllm.entrypoints.router.routes import http_error

MODEL_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/pooling",
                "/classify", "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
                "/tokenize", "/detokenize")
_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
_PARSE_OFF_LOOP = 64 << 10  # bodies larger than this are parsed on a thread


@dataclass
class FrontState:
    entries: list[ModelEntry]
    manager: ModelManager
    api_key: Optional[str]
    max_body_size: int
    http_read_timeout: float
    request_timeout: Optional[float]  # --request-timeout: a request's default deadline
    wait_timeout: float  # how long a request without a deadline waits for its model
    enable_dashboard: bool = False
    client: Any = None  # httpx.AsyncClient to the model servers
    model_name_errors: int = 0


async def current(request: Request) -> FrontState:
    return request.app.state.front


def _names(state: FrontState) -> str:
    return ", ".join(n for e in state.entries for n in e.names)


def _model_field(body: bytes) -> tuple[bool, Any]:
    """(parsed as a JSON object?, its ``model``)."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return False, None
    return isinstance(parsed, dict), parsed.get("model") if isinstance(parsed, dict) else None


async def _entry_for(state: FrontState, body: bytes) -> ModelEntry:
    is_object, name = (await asyncio.to_thread(_model_field, body) if len(body) > _PARSE_OFF_LOOP
                       else _model_field(body))
    if name is None:
        if len(state.entries) == 1:
            return state.entries[0]  # the model server answers a malformed body with its own 400
        why = "the 'model' field is required" if is_object else "the body is not a JSON object with a 'model'"
        raise ModelUnavailable(400, f"{why}: this server serves several models ({_names(state)})", "missing_model")
    entry = resolve(state.entries, name) if isinstance(name, str) else None
    if entry is None:
        state.model_name_errors += 1
        raise ModelUnavailable(404, f"The model `{name}` does not exist. Available models: {_names(state)}",
                               "model_not_found")
    return entry


def _deadline(state: FrontState, raw: Request) -> float:
    value = raw.headers.get("x-request-timeout")
    seconds = state.request_timeout or state.wait_timeout
    if value is not None:
        try:
            seconds = float(value)
        except ValueError:
            seconds = 0.0
        if not 0 < seconds < float("inf"):
            raise ModelUnavailable(400, f"the x-request-timeout header must be a positive number of seconds, got "
                                        f"{value!r}", "invalid_value")
    return time.monotonic() + seconds


def _refusal(e: ModelUnavailable) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return error_response(e.status, e.message, e.code, headers=headers)


async def _forward(state: FrontState, raw: Request, m: ServedModel, path: str, body: bytes) -> Response:
    """Send the request to the model's server (counted in flight until its answer is read out)."""
    import httpx

    header = {"x-pagedllm-model": m.name}
    try:
        req = state.client.build_request(raw.method, m.url + path, content=body, headers=request_headers(raw),
                                         params=raw.query_params)
        resp = await state.client.send(req, stream=True)
    except BaseException as e:
        state.manager.release(m)
        if isinstance(e, httpx.TransportError):
            return error_response(502, f"the server of model `{m.name}` could not take the request: "
                                       f"{type(e).__name__}", "model_server_failed", headers=header)
        raise

    async def broke(e: Exception, mid_stream: bool) -> tuple[int, str, str]:
        return 502, f"the server of model `{m.name}` failed while answering: {type(e).__name__}", "model_server_failed"

    return await relay(resp, header, lambda: state.manager.release(m), broke)


async def _routed(state: FrontState, raw: Request, path: str) -> Response:
    body = await raw.body()  # read (bounded) by the guard

    async def go() -> Response:
        try:
            entry = await _entry_for(state, body)
            m = state.manager.models[entry.name]
            await state.manager.acquire(m, _deadline(state, raw))
        except ModelUnavailable as e:
            return _refusal(e)
        return await _forward(state, raw, m, path, body)

    return await unless_disconnected(raw, go())


router = APIRouter()


def _add_model_route(path: str) -> None:
    async def handler(raw: Request, state: FrontState = Depends(current)):
        return await _routed(state, raw, path)

    router.add_api_route(path, handler, methods=["POST"], name=path)


for _path in MODEL_ROUTES:
    _add_model_route(_path)


@router.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
@router.post("/v1/responses/{response_id}/cancel")
@router.get("/v1/responses/{response_id}/input_items")
async def stored_response(raw: Request, state: FrontState = Depends(current)):
    """A stored response, from whichever loaded model server holds it."""
    path = raw.url.path
    for m in state.manager.models.values():
        if m.state is not ModelState.LOADED or m.url is None:
            continue
        try:
            resp = await state.client.request(raw.method, m.url + path, headers=request_headers(raw),
                                              params=raw.query_params)
        except Exception:  # noqa: BLE001 (that server is going away: ask the next)
            continue
        if resp.status_code != 404:
            return whole_response(resp, resp.content, {"x-pagedllm-model": m.name})
    return error_response(404, "no stored response with that id (stored responses live as long as the model "
                               "that made them stays loaded)", "not_found")


def model_card(state: FrontState, m: ServedModel, name: str, parent: Optional[str] = None) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "pagedllm",
            "root": m.entry.path, "parent": parent, "max_model_len": m.max_model_len,
            "loaded": m.state is ModelState.LOADED, "state": m.state.value, "pinned": m.entry.pinned}


def model_cards(state: FrontState) -> list[dict]:
    cards = []
    for m in state.manager.models.values():
        cards += [model_card(state, m, n) for n in m.entry.names]
        cards += [model_card(state, m, n, parent=m.name) for n in m.entry.lora_names]
    return cards


@router.get("/v1/models")
async def models(state: FrontState = Depends(current)):
    return JSONResponse({"object": "list", "data": model_cards(state)})


@router.get("/v1/models/{model_id:path}")
async def one_model(model_id: str, state: FrontState = Depends(current)):
    for card in model_cards(state):
        if card["id"] == model_id:
            return JSONResponse(card)
    return error_response(404, f"The model `{model_id}` does not exist. Available models: {_names(state)}",
                          "model_not_found")


@router.post("/v1/load_lora_adapter")
@router.post("/v1/unload_lora_adapter")
async def runtime_lora():
    return error_response(400, "a multi-model server takes no runtime LoRA changes: list each model's adapters "
                               "in --models-config (options: {lora_modules: [name=path, ...]})", "unsupported")


@router.api_route("/health", methods=["GET", "HEAD"])
@router.api_route("/ping", methods=["GET", "HEAD"])
async def health(state: FrontState = Depends(current)):
    if state.manager.closing:
        return error_response(503, "the server is shutting down", "shutting_down")
    return Response(status_code=200)


@router.get("/version")
async def version():
    from pagedllm.version import __version__

    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def metrics(state: FrontState = Depends(current)):
    from pagedllm.entrypoints.multi_model.metrics import gather_metrics
    from pagedllm.entrypoints.router.metrics import CONTENT_TYPE

    return Response(content=await gather_metrics(state), media_type=CONTENT_TYPE)


class FrontGuard:
    """Pure ASGI, outermost: the API key, then the bounded body (``http_guard.guard_body``)."""

    def __init__(self, app, state: FrontState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        def refuse(status, message, code, headers=None):
            return error_response(status, message, code, headers=headers)

        receive = await guard_body(scope, receive, send, self.state, refuse, MODEL_ROUTES, _OPEN_PATHS)
        if receive is not None:
            await self.app(scope, receive, send)


def build_front_app(state: FrontState, transport=None) -> FastAPI:
    """The app; ``transport``: an httpx transport instead of sockets (tests)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        import httpx

        timeout = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)
        state.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                                max_keepalive_connections=64),
                                         transport=transport)
        state.manager.client = state.client
        state.manager.start()
        try:
            yield
        finally:
            await state.manager.close()
            await state.client.aclose()

    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = FastAPI(title="pagedllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = state
    app.add_middleware(FrontGuard, state=state)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.include_router(router)
    if state.enable_dashboard:
        from pagedllm.entrypoints.multi_model.dashboard import router as dashboard_router

        app.include_router(dashboard_router)
    return app
