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
from contextlib import asynccontextmanager
from typing import Any, Callable, Optional

from fastapi import FastAPI

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai import generation_routes, health_routes, model_routes, tokenize_routes
from pagedllm.entrypoints.openai.body_parsing import OffLoopBodyRoute
from pagedllm.entrypoints.openai.error_handlers import add_error_handlers
from pagedllm.entrypoints.openai.middleware import InternalErrors, RequestGuard
from pagedllm.entrypoints.openai.pooling_routes import add_pooling_routes
from pagedllm.entrypoints.openai.server_args import ServerArgs, generation_overrides, uvicorn_config
from pagedllm.entrypoints.openai.server_state import ServerState, default_max_body_size, trim_loop
from pagedllm.version import __version__

__all__ = ["ServerArgs", "ServerState", "build_app", "default_max_body_size", "generation_overrides", "make_server",
           "run_server", "trim_loop", "uvicorn_config"]


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Start loading the engine and the background loops; at the end stop them and the engine."""
    state: ServerState = app.state.server
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


def add_middleware(app: FastAPI, state: ServerState) -> None:
    app.add_middleware(InternalErrors)  # innermost: a 500 that keeps the connection
    app.add_middleware(RequestGuard, state=state)  # outermost: the API key, then the bounded body
    if state.args.allowed_origins:  # CORS outside even that: a browser's preflight needs no API key
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(state.args.allowed_origins),
                           allow_methods=list(state.args.allowed_methods), allow_headers=list(state.args.allowed_headers),
                           allow_credentials=state.args.allow_credentials)


def build_app(engine_or_config: Any, served_model_name: Optional[str] = None, api_key: Optional[str] = None,
              owns_engine: Optional[bool] = None, skip_tokenizer_init: bool = False,
              state: Optional[ServerState] = None, args: Optional[ServerArgs] = None) -> FastAPI:
    """The FastAPI app over an AsyncLLM (ready at once, owned by the caller unless ``owns_engine``)
    or an EngineConfig (built on a loader thread at start-up, shut down with the app)."""
    state = state or ServerState(engine_or_config, served_model_name, api_key, owns_engine, skip_tokenizer_init,
                                 args)
    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, **({"openapi_url": None} if state.args.disable_fastapi_docs else {}))
    app.router.route_class = OffLoopBodyRoute  # large bodies are parsed on a pool of their own, not on the loop
    app.state.server = state
    add_middleware(app, state)
    add_error_handlers(app)
    for routes in (generation_routes, model_routes, health_routes, tokenize_routes):
        app.include_router(routes.router)
    if state.args.enable_dashboard:
        from pagedllm.entrypoints.openai.dashboard import add_dashboard_routes

        add_dashboard_routes(app, state)
    add_pooling_routes(app, state)
    app.include_router(health_routes.metrics_router)
    return app


def make_server(app, args: ServerArgs):
    """A uvicorn Server whose stop signal starts the drain: no new requests, in-flight ones get
    ``shutdown_timeout`` seconds, then an error (uvicorn itself waits 5 s more for those to go out)."""
    import uvicorn

    state: ServerState = app.state.server

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.loop is not None:
                state.begin_drain(state.loop, args.shutdown_timeout)
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
