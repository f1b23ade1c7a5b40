"""The OpenAI-compatible HTTP server: ``build_app(engine_or_config)`` and ``run_server(config, server_args)``.

Given an EngineConfig, the app starts serving at once and builds the engine on a loader
thread: /health answers 503 until the engine is ready, then 200. Every error is OpenAI-shaped
JSON with a non-null ``code``; a 500 names a request id, never internal details (the traceback
is logged under that id). A client that disconnects (streaming or not) aborts its engine requests.

Every response carries ``X-Request-Id`` (the client's, or a generated one; log lines carry it
too). The API key is checked and every request body (every route, the LoRA ones included) is read
by ``middleware.RequestGuard`` before the app parses anything: over ``max_request_body_size`` ->
413, a body that stalls longer than ``http_read_timeout`` -> 408, a Content-Type other than JSON
on a JSON route -> 415. An unexpected exception is a 500 that keeps the connection
(``middleware.InternalErrors``); input nested too deeply (RecursionError) is a 400. A connection that does not finish sending a
request's headers within ``http_read_timeout`` is closed (``http_guard.http_protocol``).

SIGTERM: uvicorn stops accepting, new requests get 503 ``shutting_down``, in-flight ones may
finish for ``shutdown_timeout`` seconds; then every open one is ended with an error (an error
event and ``[DONE]`` for streams), and the lifespan shutdown stops the engine; the process exits 0.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.models.gguf import default_served_name
from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import DEAD_MESSAGE
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    TokenizeRequest, TokenizeResponse, VersionResponse,
)
from pagedllm.entrypoints.openai.serving import APIError, OpenAIServing, ServingOptions, ShuttingDown
from pagedllm.entrypoints.openai import lora_modules
from pagedllm.entrypoints.openai.body_parsing import OffLoopBodyRoute
from pagedllm.entrypoints.openai.responses import ServingResponses
from pagedllm.entrypoints.openai.responses_protocol import DeletedResponse, InputItemList, ResponsesRequest
from pagedllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedllm.entrypoints.http_guard import event_loop, http_parser, http_protocol
from pagedllm.entrypoints.openai.middleware import InternalErrors, RequestGuard, error_response, json_response
from pagedllm.entrypoints.openai.pooling_routes import add_pooling_routes
from pagedllm.metrics.prometheus import PrometheusMetrics, format_log_line
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm.server")

_BASE_BODY_BYTES = 4 << 20


def default_max_body_size(max_prompt_chars: int, max_model_len: int) -> int:
    """4 MiB above the largest prompt max_model_len could hold (its characters at 4 UTF-8 bytes
    each, or its token ids as JSON numbers)."""
    return _BASE_BODY_BYTES + max(4 * max_prompt_chars, 12 * max_model_len)


class ServerState:
    """The engine (built now, or on a loader thread) and what serves over it."""

    def __init__(self, engine_or_config: Any, served_model_name: Optional[str] = None,
                 api_key: Optional[str] = None, owns_engine: Optional[bool] = None,
                 skip_tokenizer_init: bool = False, args: Optional["ServerArgs"] = None) -> None:
        self.args = args or ServerArgs()
        self.chat_template: Optional[str] = None  # --chat-template, read and compiled now (errors at start-up)
        if self.args.chat_template is not None:
            from pagedllm.tokenizer.chat_template import load_chat_template

            self.chat_template = load_chat_template(self.args.chat_template)
        if isinstance(engine_or_config, EngineConfig):
            self.config, self.engine = engine_or_config, None
        else:
            self.engine, self.config = engine_or_config, engine_or_config.config
        self.owns_engine = self.engine is None if owns_engine is None else owns_engine
        self.model_path = self.config.model
        name = served_model_name or self.config.served_model_name or default_served_name(self.config.model)
        self.served_model_names = [name]
        for extra in self.args.served_model_names:  # --served-model-name a b: every name routable
            if extra not in self.served_model_names:
                self.served_model_names.append(extra)
        self.api_key = api_key or None
        self.skip_tokenizer_init = skip_tokenizer_init
        self.metrics = PrometheusMetrics(name, prefix=self.args.metrics_prefix)
        self.max_body_size = self.args.max_request_body_size or _BASE_BODY_BYTES  # until the engine is ready
        self.draining = False
        self.template_sandbox = None
        self.serving: Optional[OpenAIServing] = None
        self.pooling = None  # a PoolingServing when the model runs the pooling runner (no generation then)
        self.load_error: Optional[BaseException] = None
        self.on_load_error: Optional[Callable[[BaseException], None]] = None
        self.on_ready: Optional[Callable[[], None]] = None  # called once the engine serves (loader thread)
        # the engine died while serving (its streams got their error): the server exits with status 1, so
        # a supervisor (systemd, Kubernetes) restarts it, as vLLM's does; called on the engine's thread
        self.engine_died = False
        self.on_engine_dead: Optional[Callable[[], None]] = None
        self._loader: Optional[threading.Thread] = None
        self._closed = False
        self._lock = threading.Lock()  # loader thread vs shutdown
        self.started = time.monotonic()
        self.ready_seconds: Optional[float] = None
        self.dashboard = None  # the DashboardRecorder (--enable-dashboard) once the engine is ready
        if self.engine is not None:
            lora_modules.register_lora_modules(self.engine, self.args.lora_modules, self.served_model_names)
            self._ready(self.engine)

    @property
    def http_read_timeout(self) -> float:
        """Seconds between a request body's chunks (``http_guard.guard_body``)."""
        return self.args.http_read_timeout

    def start_loading(self) -> None:
        if self.engine is None and self._loader is None:
            self._loader = threading.Thread(target=self._load, name="pagedllm-loader", daemon=True)
            self._loader.start()

    def _load(self) -> None:
        from pagedllm.engine.pooling_engine import wants_pooling

        try:
            if wants_pooling(self.config):
                self._load_pooling()
                return
        except BaseException as e:
            self._failed(e)
            return
        try:
            from pagedllm.engine.async_llm import AsyncLLM

            engine = AsyncLLM(self.config, skip_tokenizer_init=self.skip_tokenizer_init)
            try:  # --lora-modules: a bad adapter stops the start with its reason
                lora_modules.register_lora_modules(engine, self.args.lora_modules, self.served_model_names)
            except BaseException:
                engine.shutdown()
                raise
        except BaseException as e:
            self._failed(e)
            return
        with self._lock:
            if not self._closed:
                self._ready(engine)
                if self.on_ready is not None:
                    self.on_ready()
                return
        engine.shutdown()  # the server stopped while the engine was loading

    def _failed(self, e: BaseException) -> None:
        # One line an operator can act on; the traceback only with --log-level debug.
        detail = str(e) if isinstance(e, (ValueError, OSError)) and str(e) else f"{type(e).__name__}: {e}"
        logger.error("the engine failed to start: %s", detail, exc_info=logger.isEnabledFor(logging.DEBUG))
        self.load_error = e
        if self.on_load_error is not None:
            self.on_load_error(e)

    def _load_pooling(self) -> None:
        """The pooling engine (its own, no AsyncLLM): /v1/embeddings, /pooling, /score, /rerank."""
        from pagedllm.engine.pooling_engine import PoolingEngine
        from pagedllm.entrypoints.openai.serving_pooling import PoolingServing

        engine = PoolingEngine(self.config)
        with self._lock:
            if self._closed:
                return
            self.pooling = PoolingServing(engine, self.served_model_names)
            self.max_body_size = self.args.max_request_body_size or default_max_body_size(
                16 * engine.max_model_len * self.config.max_num_seqs, engine.max_model_len)
            self.ready_seconds = time.monotonic() - self.started
        logger.info("pooling engine ready after %.2f s: model %s (%s), max_model_len %d", self.ready_seconds,
                    self.served_model_names[0], engine.runner.arch, engine.max_model_len)
        if self.on_ready is not None:
            self.on_ready()

    def require_pooling(self):
        """The pooling handlers, or the error saying why not (loading, draining, a generative model)."""
        if self.pooling is not None and not self.draining:
            return self.pooling
        if self.serving is not None and not self.draining:
            raise APIError(400, "this server runs a generative model; embeddings, scores and rerank need a pooling "
                           "model (start the server with --runner pooling)", code="unsupported_task")
        return self.require()

    def require_up(self) -> None:
        """/health and /ping: ready to serve (generation or pooling)."""
        if self.pooling is None or self.draining:
            self.require()

    def _engine_dead(self, error: BaseException) -> None:
        self.engine_died = True
        logger.error("the engine died (%s: %s): the server exits with status 1 once the open streams have their "
                     "error", type(error).__name__, error)
        if self.on_engine_dead is not None:
            self.on_engine_dead()

    def _ready(self, engine) -> None:
        engine.on_dead = self._engine_dead
        self.metrics.attach(engine)
        if self.args.enable_dashboard:
            from pagedllm.entrypoints.openai.dashboard import attach_recorder

            self.dashboard = attach_recorder(engine)
        self.engine = engine
        if self.args.trust_request_chat_template and self.template_sandbox is None:
            from pagedllm.tokenizer.chat_template import TemplateSandbox

            self.template_sandbox = TemplateSandbox(timeout=self.args.chat_template_timeout)
        options = ServingOptions(self.args.trust_request_chat_template, self.template_sandbox,
                                 self.args.request_timeout, self.chat_template, self.args.enable_auto_tool_choice,
                                 self.args.tool_call_parser)
        options = dataclasses.replace(options, log_requests=self.args.enable_log_requests,
                                      max_logprobs=self.args.max_logprobs, response_role=self.args.response_role,
                                      reasoning_parser=self.args.reasoning_parser)
        serving = OpenAIServing(engine, self.served_model_names, self.model_path, options)
        serving.default_sampling_params.update(generation_overrides(self.args.override_generation_config))
        self.responses = ServingResponses(serving)  # before serving: a request that finds serving finds this
        self.serving = serving
        self.max_body_size = self.args.max_request_body_size or default_max_body_size(
            self.serving.input_processor.max_prompt_chars, engine.max_model_len)
        self.ready_seconds = time.monotonic() - self.started
        logger.info("engine ready after %.2f s: model %s, max_model_len %d", self.ready_seconds,
                    self.served_model_names[0], engine.max_model_len)

    def require(self) -> OpenAIServing:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", code="shutting_down")
        if self.pooling is not None:
            raise APIError(400, "this server runs a pooling model (--runner pooling): it serves /v1/embeddings, "
                           "/pooling, /score and /rerank, not generation", code="unsupported_task")
        if self.serving is None:
            if self.load_error is not None:
                raise APIError(503, "the engine failed to start (the server log has the cause)", code="engine_dead")
            raise APIError(503, "the engine is still loading; retry shortly", code="loading")
        if not self.engine.is_running:
            raise APIError(503, DEAD_MESSAGE, code="engine_dead")  # the cause was logged when it died
        return self.serving

    def begin_drain(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        """Stop admitting (503 shutting_down); after ``seconds`` end what still runs with an error."""
        if self.draining:
            return
        self.draining = True
        logger.info("shutting down: draining in-flight requests for up to %g s", seconds)
        loop.call_soon_threadsafe(lambda: loop.call_later(seconds, self.end_requests))

    def end_requests(self) -> int:
        """End every open request with a 'shutting down' error (on the event loop)."""
        n = self.serving.end_all(ShuttingDown()) if self.serving is not None else 0
        if n:
            logger.warning("shutdown: ended %d requests still running after the drain time", n)
        return n

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            engine = self.engine
        if engine is not None and self.owns_engine:
            engine.shutdown()
        if self.template_sandbox is not None:
            self.template_sandbox.close()

    async def log_loop(self, interval: float = 10.0) -> None:
        last_tokens, last_t = None, time.monotonic()
        while True:
            await asyncio.sleep(interval)
            if self.engine is None or not self.engine.is_running:  # a dead engine's last stats are not news
                continue
            stats, now = self.engine.stats, time.monotonic()
            tokens = stats.num_scheduled_tokens_total
            if last_tokens is not None and (tokens != last_tokens or stats.num_running or stats.num_waiting):
                logger.info(format_log_line(stats, (tokens - last_tokens) / max(now - last_t, 1e-9)))
            last_tokens, last_t = tokens, now


async def trim_loop(state: "ServerState", interval: float = 10.0) -> None:
    """Every ``interval`` s while no request is in flight, the heap's free memory goes back to the
    system (pagedllm/heap.py): large bodies parsed, refused or answered leave glibc's heap at its
    high-water mark otherwise. Off the event loop (a trim walks the whole heap)."""
    from pagedllm.heap import collect_and_trim

    while True:
        await asyncio.sleep(interval)
        if state.engine is not None and state.engine.num_unfinished() == 0:
            await asyncio.to_thread(collect_and_trim)


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
              state: Optional[ServerState] = None, args: Optional["ServerArgs"] = None) -> FastAPI:
    """The FastAPI app over an AsyncLLM (ready at once, owned by the caller unless ``owns_engine``)
    or an EngineConfig (built on a loader thread at start-up, shut down with the app)."""
    state = state or ServerState(engine_or_config, served_model_name, api_key, owns_engine, skip_tokenizer_init,
                                 args)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.start_loading()
        log_task = asyncio.create_task(state.log_loop() if not state.args.disable_log_stats else asyncio.sleep(0))
        trim_task = asyncio.create_task(trim_loop(state))
        try:
            yield
        finally:
            log_task.cancel()
            trim_task.cancel()
            await asyncio.to_thread(state.shutdown)

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, **({"openapi_url": None} if state.args.disable_fastapi_docs else {}))
    app.router.route_class = OffLoopBodyRoute  # large bodies are parsed on a pool of their own, not on the loop
    app.state.server = state
    app.add_middleware(InternalErrors)  # innermost: a 500 that keeps the connection
    app.add_middleware(RequestGuard, state=state)  # outermost: the API key, then the bounded body
    if state.args.allowed_origins:  # CORS outside even that: a browser's preflight needs no API key
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(state.args.allowed_origins),
                           allow_methods=list(state.args.allowed_methods), allow_headers=list(state.args.allowed_headers),
                           allow_credentials=state.args.allow_credentials)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return json_response(exc.body(), exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return error_response(400, f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
        if tuple(first.get("loc", ())) == ("body",):
            if first.get("type") == "missing":
                return error_response(400, "the request body is empty: send a JSON object", code="empty_body")
            return error_response(400, "the request body must be a JSON object", code="invalid_json")
        extra = [".".join(str(x) for x in e.get("loc", ()) if x != "body") for e in errors
                 if e.get("type") == "extra_forbidden"]
        if extra:
            return error_response(400, f"unsupported field{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}: "
                               "this server does not implement it (remove it from the request)",
                          extra[0], "unsupported_field")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        code = "invalid_type" if first.get("type") != "value_error" else "invalid_value"
        parts = []
        for e in errors[:4]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return error_response(400, "invalid request: " + "; ".join(parts), loc[0] if loc else None, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            if exc.headers and exc.headers.get("Allow"):
                message += f"; allowed: {exc.headers['Allow']}"
        elif exc.status_code == 404:
            message = f"no such route: {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=exc.headers)

    def _timeout(raw: Request) -> Optional[float]:
        value = raw.headers.get("x-request-timeout")
        if value is None:
            return None
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not seconds > 0 or seconds == float("inf"):
            raise APIError(400, f"the x-request-timeout header must be a positive number of seconds, got {value!r}",
                           param="timeout", code="invalid_value")
        return seconds

    async def _generate(raw: Request, make):
        result = await _unless_disconnected(raw, make())
        if result is _DISCONNECTED:
            return Response(status_code=499)
        if isinstance(result, tuple):  # (streams, SSE generator)
            streams, body = result
            return _SSEResponse(body, on_close=streams.close)
        return json_response(result)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        serving = state.require()
        timeout = _timeout(raw)
        return await _generate(raw, lambda: serving.create_completion(req, timeout))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        serving = state.require()
        timeout = _timeout(raw)
        return await _generate(raw, lambda: serving.create_chat_completion(req, timeout))

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        state.require()
        timeout = _timeout(raw)
        return await _generate(raw, lambda: state.responses.create(req, timeout))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        state.require()
        return json_response(state.responses.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        state.require()
        state.responses.delete(response_id)
        return json_response(DeletedResponse(id=response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        state.require()
        return json_response(await state.responses.cancel(response_id))

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str):
        state.require()
        items = state.responses.input_items(response_id)
        return json_response(InputItemList(data=items, first_id=None, last_id=None))

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str):
        max_len = state.engine.max_model_len if state.serving is not None else None
        cards = [ModelCard(id=n, root=state.model_path, max_model_len=max_len) for n in state.served_model_names]
        for card in cards + lora_modules.lora_model_cards(state.serving, max_len):
            if card.id == model_id:
                return json_response(card)
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")

    @app.get("/v1/models")
    async def models():
        max_len = state.engine.max_model_len if state.serving is not None else None
        return json_response(ModelList(data=[ModelCard(id=n, root=state.model_path, max_model_len=max_len)
                                     for n in state.served_model_names]
                                    + lora_modules.lora_model_cards(state.serving, max_len)))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        text = await lora_modules.load_lora_adapter(state.require(), req, state.args.allow_runtime_lora_updating)
        return Response(content=text, media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        text = await lora_modules.unload_lora_adapter(state.require(), req, state.args.allow_runtime_lora_updating)
        return Response(content=text, media_type="text/plain")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        state.require_up()
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "HEAD"])
    async def ping():
        state.require_up()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return json_response(VersionResponse(version=__version__))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if state.pooling is not None and not state.draining:  # a pooling server tokenizes too (as vLLM's)
            return await state.pooling.tokenize(req)
        serving = state.require()
        tokens = await serving.tokenize(req)
        return json_response(TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=serving.max_model_len))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if state.pooling is not None and not state.draining:
            return await state.pooling.detokenize(req)
        return json_response(DetokenizeResponse(prompt=state.require().detokenize(req)))

    if state.args.enable_dashboard:
        from pagedllm.entrypoints.openai.dashboard import add_dashboard_routes

        add_dashboard_routes(app, state)

    add_pooling_routes(app, state)

    @app.get("/metrics")
    async def metrics():
        dead = state.load_error is not None or (state.engine is not None and not state.engine.is_running)
        body, content_type = state.metrics.render(state.engine.stats if state.engine is not None else None,
                                                  engine_dead=dead)
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
    trust_request_chat_template: bool = False  # allow chat_template in requests (rendered in a sandbox process)
    chat_template_timeout: float = 2.0  # seconds a request's chat template may render
    chat_template: Optional[str] = None  # a template string or file replacing the model's chat template
    max_request_body_size: Optional[int] = None  # bytes; default 4 MiB above the largest prompt that fits
    http_read_timeout: float = 30.0  # seconds to receive a request's headers, and between body chunks
    request_timeout: Optional[float] = None  # default per-request deadline in seconds (None: none)
    metrics_prefix: str = "pagedllm"  # metric names are PREFIX:name ("vllm" for vLLM's dashboards)
    lora_modules: tuple[str, ...] = ()  # LoRA adapters served from the start: name=path or JSON objects
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: Optional[str] = None  # tool_parsers.TOOL_PARSERS: how "auto" reads the model's tool calls
    enable_dashboard: bool = False  # GET /dashboard: the live engine page (dashboard.py)
    # vLLM's serve flags (docs/usage.md, *vLLM's serve flags*)
    served_model_names: tuple[str, ...] = ()  # every name a request's model may use (the first is reported)
    uvicorn_log_level: Optional[str] = None  # uvicorn's own log level (default: log_level)
    uvicorn_loop: str = "auto"  # the event loop: uvloop when installed (auto), uvloop, asyncio
    uvicorn_http: str = "auto"  # the HTTP/1.1 parser: httptools when installed (auto), httptools, h11
    enable_log_requests: bool = False  # one log line per request (id, prompt length, sampling params)
    disable_log_stats: bool = False  # no periodic stats line
    max_logprobs: int = 20  # the most logprobs / top_logprobs / prompt_logprobs a request may ask for
    allowed_origins: tuple[str, ...] = ()  # CORS: origins a browser may call from (none: no CORS headers)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: Optional[str] = None  # the path prefix a proxy serves this app under
    ssl_keyfile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_ca_certs: Optional[str] = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE; 2 = CERT_REQUIRED (client certificates)
    response_role: str = "assistant"  # the role of chat replies
    disable_fastapi_docs: bool = False  # also no /openapi.json (the /docs pages are never served)
    override_generation_config: Optional[str] = None  # JSON over the model's generation_config.json defaults
    reasoning_parser: Optional[str] = None  # deepseek_r1 | qwen3: reasoning_content apart from content

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("shutdown_timeout", "chat_template_timeout", "http_read_timeout", "request_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if self.max_request_body_size is not None and self.max_request_body_size < 1024:
            raise ValueError(f"max_request_body_size must be >= 1024 bytes, got {self.max_request_body_size}")
        lora_modules.parse_lora_modules(self.lora_modules)  # malformed entries fail at start-up
        if self.tool_call_parser is not None:
            from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser")
        if not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be in 0..20 (20 is the most this server computes), "
                             f"got {self.max_logprobs}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together (TLS needs both)")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file: {path}")
        if self.root_path is not None and self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"root_path must start with '/', got {self.root_path!r}")
        if not self.response_role:
            raise ValueError("response_role must not be empty")
        generation_overrides(self.override_generation_config)  # malformed JSON fails at start-up
        event_loop(self.uvicorn_loop)  # an unknown or missing one fails at start-up
        http_parser(self.uvicorn_http)
        if self.reasoning_parser is not None:
            from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # an unknown name fails at start-up
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ValueError(f"metrics_prefix must be a metric name prefix such as pagedllm or vllm, "
                             f"got {self.metrics_prefix!r}")


_GENERATION_KEYS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "max_tokens"}


def generation_overrides(text: Optional[str]) -> dict[str, Any]:
    """--override-generation-config: a JSON object over the model's generation defaults (vLLM's
    flag; ``max_new_tokens`` is max_tokens); ValueError naming the flag."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"override_generation_config is not valid JSON: {e}") from None
    if not isinstance(value, dict) or set(value) - _GENERATION_KEYS:
        raise ValueError(f"override_generation_config must be a JSON object of {', '.join(sorted(_GENERATION_KEYS))}, "
                         f"got {text!r}")
    if "max_new_tokens" in value:
        value["max_tokens"] = value.pop("max_new_tokens")
    return value


def uvicorn_config(app, args: ServerArgs, **kw):
    """The uvicorn settings of ``pagedllm serve`` (tests use them too)."""
    import uvicorn

    tls = {}
    if args.ssl_certfile is not None:
        tls = dict(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                   ssl_cert_reqs=args.ssl_cert_reqs)
    return uvicorn.Config(
        app, host=args.host, port=args.port, log_level=(args.uvicorn_log_level or args.log_level).lower(),
        access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout + 5, timeout_keep_alive=5,
        loop=event_loop(args.uvicorn_loop), http=http_protocol(args.uvicorn_http, args.http_read_timeout),
        root_path=args.root_path or "", **tls, **kw,
    )


def make_server(app, args: ServerArgs):
    """A uvicorn Server whose stop signal starts the drain: no new requests, in-flight ones get
    ``shutdown_timeout`` seconds, then an error (uvicorn itself waits 5 s more for those to go out)."""
    import uvicorn

    state: ServerState = app.state.server

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            loop = getattr(state, "loop", None)
            if loop is not None:
                state.begin_drain(loop, args.shutdown_timeout)
            super().handle_exit(sig, frame)

    return _Server(uvicorn_config(app, args))


def run_server(config: EngineConfig, server_args: ServerArgs,
               stop_requested: Callable[[], bool] = lambda: False, sock=None) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code (0 after a graceful stop).
    ``stop_requested`` says whether a stop signal came before this function took over; ``sock``:
    the listening socket, already bound (``http_guard.listen_socket``; bound here without one)."""
    import signal

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
    if sock is None:
        from pagedllm.entrypoints.http_guard import listen_socket

        sock = listen_socket(args.host, args.port)  # a bad host or a busy port: one line, before any loading
    state = ServerState(config, None, args.api_key, skip_tokenizer_init=args.skip_tokenizer_init, args=args)
    from pagedllm.heap import freeze_startup_objects

    state.on_ready = freeze_startup_objects  # this process serves until it exits: see heap.py
    state.start_loading()  # overlaps model loading with the web stack's start-up
    app = build_app(config, state=state)
    server = make_server(app, args)
    holder["server"] = server

    def load_failed(e: BaseException) -> None:
        server.should_exit = True

    def engine_dead() -> None:  # uvicorn's graceful stop lets the streams write their error event first
        server.should_exit = True

    state.on_load_error = load_failed
    state.on_engine_dead = engine_dead
    if state.load_error is not None:
        return 1
    if holder["stop"]:
        state.shutdown()
        return 0
    server.run(sockets=[sock])
    return 1 if state.load_error is not None or state.engine_died else 0
