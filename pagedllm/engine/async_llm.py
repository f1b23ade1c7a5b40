"""AsyncLLM: the engine's front end on a background thread, one async stream per request.

The event loop never waits for a step: a request is validated and tokenised once on the
caller's side (InputProcessor -> EngineCoreRequest, so bad input raises at once), then handed
to the engine thread through a command queue; outputs come back through
``loop.call_soon_threadsafe``. A stream that is closed early (client disconnect, cancellation)
aborts its request, which frees its KV blocks at the next loop turn.

The engine thread runs the LLMEngine front end: with the core in its own process (the server's
default, ``multiprocess=True``) it only sends requests and turns the core's outputs into
RequestOutputs (detokenisation, stop strings), while the core process steps on its own; with an
in-process core it also runs the steps. A core process that dies ends every stream with
EngineDeadError within a loop turn and ``is_running`` turns False (/health answers 503).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from pagedllm.config import EngineConfig, resolve_max_waiting_requests
from pagedllm.engine.core_client import EngineDeadError, core_in_own_process  # noqa: F401 (re-exported)
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import OUTPUT_DELTA, LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.engine.best_of import num_sequences
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


def sequences_of(params) -> int:
    """Sequences a request runs at once: n, best_of when larger, a beam search's width."""
    return params.n if isinstance(params, BeamSearchParams) else num_sequences(params)


# What a client is told: the cause (paths, ports, exception text) is in the server log only.
DEAD_MESSAGE = "the engine has stopped after an internal failure (the server log has the cause); restart the server"


class QueueFullError(RuntimeError):
    """Too many sequences are waiting; the caller should retry later (HTTP 429 + Retry-After)."""


class RequestFailedError(RuntimeError):
    """The engine step running this request raised; the others go on (HTTP 500)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # loop closed: nobody listens anymore
            pass


def _put_all(items: list) -> None:
    """On the event loop: one step's outputs into their streams' queues."""
    for q, item in items:
        q.put_nowait(item)


def _deliver(batch: dict) -> None:
    """One step's outputs, one ``call_soon_threadsafe`` per event loop (not one per stream: at
    saturation hundreds of wake-ups a step kept the loop, and /health with it, from its sockets)."""
    for loop, items in batch.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # loop closed: nobody listens anymore
            pass


class AsyncLLM:
    """``multiprocess`` (when it builds the engine): the core in its own process; None:
    EngineConfig.engine_core_process, whose default here is on."""

    def __init__(self, config: EngineConfig, engine: Optional[LLMEngine] = None,
                 multiprocess: Optional[bool] = None, skip_tokenizer_init: bool = False) -> None:
        self.config = config
        self.engine = engine or LLMEngine(config, skip_tokenizer_init=skip_tokenizer_init,
                                          multiprocess=core_in_own_process(config, server=True)
                                          if multiprocess is None else multiprocess)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.input_processor = self.engine.input_processor
        self.lora_registry = self.engine.lora_registry
        self.default_sampling_params = self.engine.default_sampling_params  # from generation_config.json
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._num_pending = 0  # sequences (n per request) submitted, not yet finished (admission limit)
        self._pending_seqs: dict[str, int] = {}
        self.max_pending_seqs = config.max_num_seqs + resolve_max_waiting_requests(config)
        self.num_queue_full = 0  # requests refused by that limit (QueueFullError; vLLM's admission_rejections)
        self.step_cost = self.engine.client.limits.step_cost  # the step performance model, for the metrics
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self.dead_error: Optional[BaseException] = None
        self.stats = self.engine.get_stats()
        self.on_finished = None  # optional callback(RequestOutput) on the engine thread (metrics)
        self.on_dead = None  # optional callback(the error) on the engine thread once the loop died
        self.on_step = None  # optional callback(stats, step_seconds) on the engine thread
        self.on_step_phases = None  # optional callback(StepTiming, output_seconds) per core step
        # seconds between each request's consecutive outputs, gathered since the previous on_step
        # (vLLM's inter-token latencies; the metrics read it in their on_step callback)
        self.last_token_gaps: list[float] = []
        self.engine.output_processor.take_token_gaps()  # starts collecting them
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)
        self._thread.start()

    # ---- client side (event loop) -----------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None

    def num_unfinished(self) -> int:
        return self._num_pending

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None, lora_request=None,
        deadline: Optional[float] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields delta RequestOutputs; the last one has ``finished=True``. ``lora_request``: the
        LoRA adapter to run with (None: the base model). ``deadline``: time.monotonic() past which
        the core ends the request itself ("abort"), wherever it is (core/deadlines.py)."""
        if not self.is_running:
            raise EngineDeadError(DEAD_MESSAGE)
        # Capacity in flight = max_num_seqs running + max_waiting_requests queued, in sequences
        # (a request with n=8 is 8). Counted on this side (not from the engine's last stats
        # snapshot) so a burst is judged exactly.
        capacity = self.max_pending_seqs
        seqs = sequences_of(params)
        self.check_can_fit(seqs)
        if self._num_pending + seqs > capacity:
            self.num_queue_full += 1
            raise QueueFullError(
                f"the server is overloaded: {self._num_pending} sequences in flight and this request adds "
                f"{seqs}; the limit is max_num_seqs + max_waiting_requests = {capacity}; retry later"
            )
        request_id = request_id or f"req-{time.monotonic_ns()}-{id(prompt)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Validated and tokenised once, here (ValueError on bad input, here and now).
        processed = self.engine.make_request(request_id, prompt, params, time.monotonic(), lora_request, deadline)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._count(request_id, seqs)
        self._commands.put(("add", processed))
        self._wake()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            if not finished:
                self.abort(request_id)

    def check_can_fit(self, seqs: int) -> None:
        """A request of ``seqs`` sequences (all its prompts) that could not fit even an idle
        server is the client's error (HTTP 400), never an overload to retry (429)."""
        if seqs > self.max_pending_seqs:
            raise ValueError(f"n (x best_of, beam width, prompts) asks for {seqs} sequences at once; this server "
                             f"can never hold more than max_num_seqs + max_waiting_requests = {self.max_pending_seqs}")

    def _count(self, request_id: str, n: int) -> None:
        with self._pending_lock:
            self._pending_seqs[request_id] = n
            self._num_pending += n

    def _release(self, request_id: str) -> None:
        with self._pending_lock:
            self._num_pending -= self._pending_seqs.pop(request_id, 0)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake()

    def _wake(self) -> None:
        self._wakeup.set()
        self.engine.client.wake()  # a core in another process: stop waiting for its output

    async def get_stats(self):
        return self.stats

    def core_snapshot(self) -> dict:
        """The core's running and waiting requests and KV block map (EngineCore.snapshot); blocking."""
        return self.engine.client.snapshot()

    def compile_structured_outputs(self, params):
        """The compile of the request's constraint, on the compile pool (a Future; None without one)."""
        return self.engine.input_processor.compile_structured_outputs(params)

    def check_structured_outputs(self, params) -> None:
        """Compile a request's output constraint (ValueError naming the field); blocking."""
        self.engine.check_structured_outputs(params)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout)
        self.engine.shutdown()

    # ---- engine thread ----------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                processed = cmd[1]
                rid = processed.request.request_id
                stream = self._streams.get(rid)
                if stream is None:
                    self._release(rid)
                    continue  # aborted before it was added
                try:
                    self.engine.add_core_request(processed, OUTPUT_DELTA)
                except Exception as e:  # e.g. duplicate id: fail this request only
                    self._streams.pop(rid, None)
                    self._release(rid)
                    stream.put(e)
            else:
                rid = cmd[1]
                self._streams.pop(rid, None)
                self._release(rid)
                try:
                    finals = self.engine.abort_request(rid)
                except Exception:  # this request's cleanup, not the engine's
                    logger.exception("request %s: aborting it raised", rid)
                    finals = []
                for out in finals:
                    self._notify_finished(out)

    def _notify_step(self, timing, seconds: float) -> None:
        """The step callbacks (a core in another process: its own step time); a failure there is
        logged, never the engine's."""
        try:
            self.last_token_gaps = self.engine.output_processor.take_token_gaps()
            if self.on_step is not None:
                self.on_step(self.stats, seconds if self.engine.client.in_process else timing.total)
            if self.on_step_phases is not None:
                self.on_step_phases(timing, self.engine.last_output_seconds)
        except Exception:
            logger.exception("the on_step callback raised")

    def _notify_finished(self, out: RequestOutput) -> None:
        """The metrics callback; a failure there is logged, never the engine's."""
        if self.on_finished is None:
            return
        try:
            self.on_finished(out)
        except Exception:
            logger.exception("the on_finished callback raised for request %s", out.request_id)

    def _close(self) -> None:
        """The loop was told to stop: apply the aborts already sent, then end whatever still runs
        (its stream gets an error, its blocks go back), so a stopped engine holds nothing."""
        self._drain_commands()
        rids = list(self._streams)
        for rid in rids:
            self._streams.pop(rid).put(EngineDeadError("the engine was shut down"))
            self._release(rid)
        if rids:
            for out in self.engine.abort_request(rids):
                self._notify_finished(out)
        self.stats = self.engine.get_stats()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                engine = self.engine
                if not engine.has_unfinished_requests() and engine.client.in_process:
                    engine.client.check_alive()  # e.g. a Ray worker died while idle: fail now, /health turns 503
                    self.stats = engine.get_stats()
                    # the core's idle work a slice at a time (a request waits at most one), then sleep
                    self._wakeup.wait(0.0 if engine.client.idle_work(0.002) else 0.5)
                    self._wakeup.clear()
                    continue
                t0 = time.perf_counter()
                outputs = engine.step()  # a core in another process: its next outputs (waits up to 0.5 s)
                core_outputs = engine.last_core_outputs
                self.stats = core_outputs.stats or self.stats
                if core_outputs.timing is not None:  # a core step ran
                    self._notify_step(core_outputs.timing, time.perf_counter() - t0)
                batch: dict = {}  # event loop -> [(stream queue, item)]
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                        self._release(out.request_id)
                        self._notify_finished(out)
                    if stream is not None:
                        item = out
                        if out.finished and any(c.finish_reason == "error" for c in out.outputs):
                            item = RequestFailedError(f"request {out.request_id} failed inside the engine (see the "
                                                      "server log); other requests are unaffected")
                        batch.setdefault(stream.loop, []).append((stream.queue, item))
                _deliver(batch)
            self._close()
        except BaseException as e:  # the engine is broken: fail every stream, fast
            logger.exception("engine loop died")
            self.dead_error = e
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(DEAD_MESSAGE))
            self._streams.clear()
            if self.on_dead is not None:
                try:
                    self.on_dead(e)
                except Exception:
                    logger.exception("the engine's on_dead callback failed")
