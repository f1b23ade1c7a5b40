"""The OpenAI-compatible HTTP server: ``build_app(engine_or_config)`` and ``run_server(config, server_args)``.

Given an EngineConfig, the app starts serving at once and builds the engine on a loader
thread: /health answers 503 until the engine is ready, then 200. Every error is OpenAI-shaped
JSON. A client that disconnects (streaming or not) aborts its engine requests. SIGTERM: uvicorn
stops accepting, lets in-flight requests finish (up to ``shutdown_timeout``, then cancels them,
which aborts them), and the lifespan shutdown stops the engine; the process exits 0.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    TokenizeRequest, TokenizeResponse, VersionResponse,
)
from pagedllm.entrypoints.openai.serving import APIError, OpenAIServing
from pagedllm.metrics.prometheus import PrometheusMetrics, format_log_line
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})


def _json(model, status: int = 200) -> Response:
    return Response(content=model.model_dump_json(), status_code=status, media_type="application/json")


def _error(status: int, message: str, param=None, code=None, type=None) -> Response:
    return _json(APIError(status, message, param, code, type).body(), status)


class ServerState:
    """The engine (built now, or on a loader thread) and what serves over it."""

    def __init__(self, engine_or_config: Any, served_model_name: Optional[str] = None,
                 api_key: Optional[str] = None, owns_engine: Optional[bool] = None,
                 skip_tokenizer_init: bool = False) -> None:
        if isinstance(engine_or_config, EngineConfig):
            self.config, self.engine = engine_or_config, None
        else:
            self.engine, self.config = engine_or_config, engine_or_config.config
        self.owns_engine = self.engine is None if owns_engine is None else owns_engine
        self.model_path = self.config.model
        name = served_model_name or self.config.served_model_name or self.config.model
        self.served_model_names = [name]
        self.api_key = api_key or None
        self.skip_tokenizer_init = skip_tokenizer_init
        self.metrics = PrometheusMetrics(name)
        self.serving: Optional[OpenAIServing] = None
        self.load_error: Optional[BaseException] = None
        self.on_load_error: Optional[Callable[[BaseException], None]] = None
        self._loader: Optional[threading.Thread] = None
        self._closed = False
        self._lock = threading.Lock()  # loader thread vs shutdown
        self.started = time.monotonic()
        self.ready_seconds: Optional[float] = None
        if self.engine is not None:
            self._ready(self.engine)

    def start_loading(self) -> None:
        if self.engine is None and self._loader is None:
            self._loader = threading.Thread(target=self._load, name="pagedllm-loader", daemon=True)
            self._loader.start()

    def _load(self) -> None:
        try:
            from pagedllm.engine.async_llm import AsyncLLM
            from pagedllm.engine.llm_engine import LLMEngine

            engine = AsyncLLM(self.config, LLMEngine(self.config, skip_tokenizer_init=self.skip_tokenizer_init))
        except BaseException as e:
            logger.exception("the engine failed to start")
            self.load_error = e
            if self.on_load_error is not None:
                self.on_load_error(e)
            return
        with self._lock:
            if not self._closed:
                self._ready(engine)
                return
        engine.shutdown()  # the server stopped while the engine was loading

    def _ready(self, engine) -> None:
        self.metrics.attach(engine)
        self.engine = engine
        self.serving = OpenAIServing(engine, self.served_model_names, self.model_path)
        self.ready_seconds = time.monotonic() - self.started
        logger.info("engine ready after %.2f s: model %s, max_model_len %d", self.ready_seconds,
                    self.served_model_names[0], engine.max_model_len)

    def require(self) -> OpenAIServing:
        if self.serving is None:
            if self.load_error is not None:
                raise APIError(503, f"the engine failed to start: {self.load_error!r}", code="engine_dead")
            raise APIError(503, "the engine is still loading; retry shortly", code="loading")
        if not self.engine.is_running:
            raise APIError(503, f"the engine is not running: {self.engine.dead_error!r}", code="engine_dead")
        return self.serving

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            engine = self.engine
        if engine is not None and self.owns_engine:
            engine.shutdown()

    async def log_loop(self, interval: float = 10.0) -> None:
        last_tokens, last_t = None, time.monotonic()
        while True:
            await asyncio.sleep(interval)
            if self.engine is None:
                continue
            stats, now = self.engine.stats, time.monotonic()
            tokens = stats.num_scheduled_tokens_total
            if last_tokens is not None and (tokens != last_tokens or stats.num_running or stats.num_waiting):
                logger.info(format_log_line(stats, (tokens - last_tokens) / max(now - last_t, 1e-9)))
            last_tokens, last_t = tokens, now


class _AuthMiddleware:
    """Bearer API key on everything but the open paths (pure ASGI: streaming is untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self._key):
                resp = _error(401, "Incorrect or missing API key: pass 'Authorization: Bearer <key>'.",
                              code="invalid_api_key")
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class _SSEResponse(StreamingResponse):
    """A streaming response that always runs ``on_close`` (abort the engine requests), however
    the stream ends: finished, client gone, or cancelled at shutdown."""

    def __init__(self, content, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


_DISCONNECTED = object()


async def _unless_disconnected(raw: Request, coro):
    """Run ``coro``; if the client goes away first, cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> bool:
        while True:
            if (await raw.receive())["type"] == "http.disconnect":
                task.cancel()
                return True

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled() and watcher.result():
            return _DISCONNECTED
        raise
    finally:
        watcher.cancel()


def build_app(engine_or_config: Any, served_model_name: Optional[str] = None, api_key: Optional[str] = None,
              owns_engine: Optional[bool] = None, skip_tokenizer_init: bool = False,
              state: Optional[ServerState] = None) -> FastAPI:
    """The FastAPI app over an AsyncLLM (ready at once, owned by the caller unless ``owns_engine``)
    or an EngineConfig (built on a loader thread at start-up, shut down with the app)."""
    state = state or ServerState(engine_or_config, served_model_name, api_key, owns_engine, skip_tokenizer_init)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        log_task = asyncio.create_task(state.log_loop())
        try:
            yield
        finally:
            log_task.cancel()
            await asyncio.to_thread(state.shutdown)

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.server = state
    if state.api_key:
        app.add_middleware(_AuthMiddleware, api_key=state.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _json(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return _error(400, f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        code = "invalid_type"
        parts = []
        for e in errors[:4]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return _error(400, "invalid request: " + "; ".join(parts), loc[0] if loc else None, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return _error(500, f"internal error: {exc!r}", code="internal_error", type="server_error")

    async def _generate(raw: Request, make):
        result = await _unless_disconnected(raw, make())
        if result is _DISCONNECTED:
            return Response(status_code=499)
        if isinstance(result, tuple):  # (streams, SSE generator)
            streams, body = result
            return _SSEResponse(body, on_close=streams.close)
        return _json(result)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        serving = state.require()
        return await _generate(raw, lambda: serving.create_completion(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        serving = state.require()
        return await _generate(raw, lambda: serving.create_chat_completion(req))

    @app.get("/v1/models")
    async def models():
        max_len = state.engine.max_model_len if state.serving is not None else None
        return _json(ModelList(data=[ModelCard(id=n, root=state.model_path, max_model_len=max_len)
                                     for n in state.served_model_names]))

    @app.get("/health")
    async def health():
        state.require()
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        state.require()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return _json(VersionResponse(version=__version__))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving = state.require()
        tokens = serving.tokenize(req)
        return _json(TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=serving.max_model_len))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return _json(DetokenizeResponse(prompt=state.require().detokenize(req)))

    @app.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.render(state.engine.stats if state.engine is not None else None)
        return Response(content=body, media_type=content_type)

    return app


@dataclass(frozen=True)
class ServerArgs:
    """The HTTP server's own settings (the engine's are the EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    log_level: str = "info"
    access_log: bool = False
    shutdown_timeout: float = 30.0
    skip_tokenizer_init: bool = False


def run_server(config: EngineConfig, server_args: ServerArgs,
               stop_requested: Callable[[], bool] = lambda: False) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code (0 after a graceful stop).
    ``stop_requested`` says whether a stop signal came before this function took over."""
    import signal

    import uvicorn

    # A stop signal at any moment (even before uvicorn installs its own handlers, which it
    # restores and re-raises at exit) ends the server gracefully: exit code 0, never -15.
    holder: dict[str, Any] = {"stop": bool(stop_requested())}

    def on_signal(sig, frame) -> None:
        holder["stop"] = True
        if "server" in holder:
            holder["server"].should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    args = server_args
    state = ServerState(config, None, args.api_key, skip_tokenizer_init=args.skip_tokenizer_init)
    state.start_loading()  # overlaps model loading with the web stack's start-up
    app = build_app(config, state=state)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=args.access_log,
        timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=5,
    ))
    holder["server"] = server

    def load_failed(e: BaseException) -> None:
        server.should_exit = True

    state.on_load_error = load_failed
    if state.load_error is not None:
        return 1
    if holder["stop"]:
        state.shutdown()
        return 0
    server.run()
    return 1 if state.load_error is not None else 0
