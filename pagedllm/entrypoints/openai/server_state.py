"""``ServerState``: the engine (built now, or on a loader thread) and what serves over it, the
drain at shutdown, and the server's background loops (the stats log line, the heap trim).
Route handlers reach it as ``request.app.state.server`` (the ``current_server`` dependency)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional

from fastapi import Request

from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import DEAD_MESSAGE
from pagedllm.entrypoints.openai import lora_modules
from pagedllm.entrypoints.openai.responses import ServingResponses
from pagedllm.entrypoints.openai.server_args import ServerArgs, generation_overrides
from pagedllm.entrypoints.openai.serving import APIError, OpenAIServing, ServingOptions, ShuttingDown
from pagedllm.metrics.prometheus import PrometheusMetrics, format_log_line
from pagedllm.models.gguf import default_served_name

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
                 skip_tokenizer_init: bool = False, args: Optional[ServerArgs] = None) -> None:
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
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # the app's event loop, once its lifespan starts
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
        self._planned_max_model_len: Optional[tuple[Optional[int]]] = None  # (value,) once read
        if self.engine is not None:
            lora_modules.register_lora_modules(self.engine, self.args.lora_modules, self.served_model_names)
            self._ready(self.engine)

    @property
    def http_read_timeout(self) -> float:
        """Seconds between a request body's chunks (``http_guard.guard_body``)."""
        return self.args.http_read_timeout

    def planned_max_model_len(self) -> Optional[int]:
        """While the engine loads: the max_model_len it is configured for (the one it was given, else
        the checkpoint's context length); None if the checkpoint's config cannot be read."""
        if self._planned_max_model_len is None:  # read once (the answer, or the configured one on error)
            requested = self.config.max_model_len
            try:
                from pagedllm.config import resolve_max_model_len
                from pagedllm.models.config_json import load_hf_config

                self._planned_max_model_len = (resolve_max_model_len(load_hf_config(self.config.model), requested),)
            except Exception:  # noqa: BLE001 (the loader reports a bad checkpoint)
                self._planned_max_model_len = (requested,)
        return self._planned_max_model_len[0]

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
        """The pooling engine (its own, no AsyncLLM): /v1/embeddings, /pooling, /score, /rerank, /classify."""
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
                           "/pooling, /score, /rerank and /classify, not generation", code="unsupported_task")
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


async def trim_loop(state: ServerState, interval: float = 10.0) -> None:
    """Every ``interval`` s while no request is in flight, the heap's free memory goes back to the
    system (pagedllm/heap.py): large bodies parsed, refused or answered leave glibc's heap at its
    high-water mark otherwise. Off the event loop (a trim walks the whole heap)."""
    from pagedllm.heap import collect_and_trim

    while True:
        await asyncio.sleep(interval)
        if state.engine is not None:
            idle = state.engine.num_unfinished() == 0
        else:  # a pooling server (no generating engine), once loaded
            idle = state.pooling is not None and state.pooling.num_in_flight == 0
        if idle:
            await asyncio.to_thread(collect_and_trim)


async def current_server(request: Request) -> ServerState:
    """The app's ServerState (a FastAPI dependency of the route handlers)."""
    return request.app.state.server
