"""EngineCoreClient: how the front end (LLMEngine: input and output processing) talks to the core.

Two implementations of one Protocol:

- ``InprocClient``: the EngineCore lives in this process; ``get_output`` runs one step.
- ``MultiprocClient``: the EngineCore runs in a process of its own (engine/core_proc.py), so
  the scheduler, the KV cache manager and the executor never share a GIL with the HTTP event
  loop, tokenisation or detokenisation. Requests, aborts and calls go down one pipe, pickled
  (protocol 5); the core sends one ``EngineCoreOutputs`` per step back up another. A core that
  dies is seen at once (its process sentinel is waited on with the pipe): the next
  ``get_output`` raises ``EngineCoreDeadError``.

``get_output(timeout)`` returns the next outputs (possibly empty): the in-process client steps;
the multiprocess one waits up to ``timeout`` for the core's next message, and returns early
(empty) when ``wake()`` is called from another thread (a request to send).
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import pickle
import socket
import threading
import time
from concurrent.futures import Future, InvalidStateError, wait as futures_wait
from multiprocessing.connection import wait
from typing import Optional, Protocol

from pagedllm.core.contracts import EngineCoreOutput, SchedulerStats
from pagedllm.core.engine_request import EngineCoreOutputs, EngineCoreRequest, EngineLimits
from pagedllm.engine.core import finish_status

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core (its process, or its executor's workers) is gone (HTTP 503)."""


EngineCoreDeadError = EngineDeadError


class EngineCoreClient(Protocol):
    limits: EngineLimits  # what the core holds (max_model_len after the KV cache is sized, blocks, ...)
    in_process: bool

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str], reason: str = "abort") -> list[EngineCoreOutput]:
        """Finish these core requests (``reason``: "abort", "stop" for a stop string, "error" for
        an output the front end could not process). Returns what the core answered at once (an
        in-process core: the beam groups' live beams)."""
        ...

    def get_output(self, timeout: float = 0.5) -> EngineCoreOutputs: ...

    def wake(self) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_stats(self) -> SchedulerStats: ...

    def reset_prefix_cache(self) -> bool: ...

    def num_forward_tokens(self) -> int: ...

    def snapshot(self) -> dict:
        """EngineCore.snapshot(): the scheduler's requests and the KV block map."""
        ...

    def check_alive(self) -> None:
        """Raise EngineCoreDeadError when the core cannot run another step."""
        ...

    def idle_work(self, seconds: float) -> bool:
        """An idle in-process core's idle work (EngineCore.idle_work); whether any is left. A core
        in its own process does its own: False."""
        ...

    def shutdown(self) -> None: ...





class InprocClient:
    in_process = True

    def __init__(self, core) -> None:
        self.core = core
        self.limits = core.limits()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids, reason: str = "abort") -> list[EngineCoreOutput]:
        return self.core.abort_requests(request_ids, finish_status(reason))

    def get_output(self, timeout: float = 0.5) -> EngineCoreOutputs:
        if not self.core.has_unfinished_requests():
            return EngineCoreOutputs([], self.core.get_stats())
        outputs = self.core.step()
        return EngineCoreOutputs(outputs, self.core.get_stats(), self.core.last_timing)

    def wake(self) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def num_forward_tokens(self) -> int:
        return self.core.executor.num_forward_tokens

    def snapshot(self) -> dict:
        return self.core.snapshot()

    def check_alive(self) -> None:
        executor = self.core.executor
        if executor.is_dead:  # e.g. a Ray worker died while idle
            raise EngineCoreDeadError(executor.dead_reason or "the engine's workers died")

    def idle_work(self, seconds: float) -> bool:
        return self.core.idle_work(seconds)

    def shutdown(self) -> None:
        self.core.shutdown()


# ---- the multiprocess client ------------------------------------------------------------------
def _send(conn, lock: threading.Lock, msg) -> None:
    data = pickle.dumps(msg, protocol=5)
    with lock:
        conn.send_bytes(data)


class MultiprocClient:
    """The core in a child process (spawned, not forked: torch and OpenMP threads do not
    survive a fork). The child exits when its input pipe closes (this process died), when it is
    told to, or on SIGTERM; start-up errors (a bad model path, too little memory) are raised
    here, as the in-process constructor would."""

    in_process = False
    startup_timeout = 600.0

    def __init__(self, config, skip_tokenizer_init: bool = False, executor_factory=None) -> None:
        from pagedllm.engine.core_proc import run_engine_core

        ctx = multiprocessing.get_context("spawn")
        self._in_r, self._in_w = ctx.Pipe(duplex=False)  # requests: front end -> core
        self._out_r, self._out_w = ctx.Pipe(duplex=False)  # outputs: core -> front end
        # Not daemonic: a daemonic process may not start the executor's own worker processes.
        self.proc = ctx.Process(target=run_engine_core, name="pagedllm-engine-core",
                                args=(config, skip_tokenizer_init, executor_factory, self._in_r, self._out_w,
                                      logging.getLogger().getEffectiveLevel()))
        self.proc.start()
        self._in_r.close()
        self._out_w.close()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._pending: list[EngineCoreOutputs] = []  # outputs read by a thread waiting for a reply
        self._calls: dict[int, Future] = {}  # calls the core has not answered yet, by call id
        self._calls_lock = threading.Lock()
        self._next_call = 0
        self._dead: Optional[str] = None
        self._closed = False
        self._stats: Optional[SchedulerStats] = None
        self._unfinished = 0  # core requests the core reported unfinished, plus sent since
        atexit.register(self.shutdown)
        info = self._await_ready()
        self.limits: EngineLimits = info["limits"]
        self._stats = info["stats"]

    def _await_ready(self) -> dict:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            ready = wait([self._out_r, self.proc.sentinel], max(0.0, deadline - time.monotonic()))
            if self._out_r in ready:
                try:
                    kind, payload = pickle.loads(self._out_r.recv_bytes())
                except Exception:  # EOF, or an error that does not unpickle
                    kind, payload = "failed", None
                if kind == "ready":
                    return payload
                self._reap()
                if isinstance(payload, BaseException):
                    raise payload
                raise EngineCoreDeadError(f"the engine core process failed to start (exit code {self.proc.exitcode})")
            if self.proc.sentinel in ready or not ready:
                self._reap()
                raise EngineCoreDeadError(f"the engine core process failed to start (exit code {self.proc.exitcode})")

    def _reap(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` for the process to end (then terminate, then kill it) and close
        this side's pipes."""
        self._closed = True
        atexit.unregister(self.shutdown)
        self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("the engine core process did not stop within %g s: terminating it", timeout)
            self.proc.terminate()
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        for c in (self._in_w, self._out_r, self._wake_r, self._wake_w):
            c.close()

    # ---- requests in ------------------------------------------------------------------------
    def _post(self, msg) -> None:
        self.check_alive()
        try:
            data = pickle.dumps(msg, protocol=5)
        except Exception as e:  # e.g. offline logits_processors (callables) in the sampling params
            raise ValueError(f"the request cannot be sent to the engine core process ({e}); run the core in "
                             "this process for it") from None
        try:
            with self._send_lock:
                self._in_w.send_bytes(data)
        except (OSError, EOFError) as e:
            self._dead = self._dead or f"the engine core process is gone ({e!r})"
            raise EngineCoreDeadError(self._dead) from None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._unfinished += 1
        self._post(("add", request))

    def abort_requests(self, request_ids, reason: str = "abort") -> list[EngineCoreOutput]:
        finish_status(reason)  # a KeyError here, not in the core
        self._post(("abort", list(request_ids), reason))
        return []  # a beam group's live beams are not waited for (its abort output is dropped)

    def wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    # ---- outputs out ------------------------------------------------------------------------
    def get_output(self, timeout: float = 0.5) -> EngineCoreOutputs:
        if self._pending:
            return self._pending.pop(0)
        with self._recv_lock:
            if self._pending:
                return self._pending.pop(0)
            return self._read(timeout) or EngineCoreOutputs([], self._stats)

    def _read(self, timeout: float) -> Optional[EngineCoreOutputs]:
        """One message from the core (under the read lock): outputs are returned, replies filed."""
        self.check_alive()
        ready = wait([self._out_r, self._wake_r, self.proc.sentinel], timeout)
        if self._wake_r in ready:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        if self._out_r in ready:
            try:
                msg = pickle.loads(self._out_r.recv_bytes())
            except (EOFError, OSError):
                msg = ("dead", None)
            return self._dispatch(msg)
        if self.proc.sentinel in ready:
            self._died(None)
        return None

    def _dispatch(self, msg) -> Optional[EngineCoreOutputs]:
        kind = msg[0]
        if kind == "outputs":
            outs: EngineCoreOutputs = msg[1]
            self._stats = outs.stats or self._stats
            self._unfinished = msg[2]
            return outs
        if kind == "reply":
            with self._calls_lock:
                fut = self._calls.pop(msg[1], None)
            if fut is not None:
                ok, value = msg[2]
                try:
                    fut.set_result(value) if ok else fut.set_exception(value)
                except InvalidStateError:  # withdrawn by its caller meanwhile
                    pass
            return None
        self._died(msg[1])
        return None

    def _died(self, reason: Optional[str]) -> None:
        self.proc.join(1)
        self._dead = self._dead or (reason or f"the engine core process died (exit code {self.proc.exitcode})")
        with self._calls_lock:
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            try:
                fut.set_exception(EngineCoreDeadError(self._dead))
            except InvalidStateError:
                pass
        raise EngineCoreDeadError(self._dead)

    def call_async(self, method: str, *args) -> Future:
        """Run ``_CoreLoop._call_<method>(*args)`` in the core: a Future of its answer (its
        exception is the Future's). The answer is read by whichever thread reads the pipe (the
        engine thread, or ``_call``); cancelling the Future withdraws the call in the core (an
        asynchronous one there, e.g. a grammar compile, is cancelled too)."""
        fut: Future = Future()
        with self._calls_lock:
            call_id = self._next_call
            self._next_call += 1
            self._calls[call_id] = fut
        try:
            self._post(("call", call_id, method, args))
        except BaseException:
            with self._calls_lock:
                self._calls.pop(call_id, None)
            raise
        fut.add_done_callback(lambda f, c=call_id: self._withdraw(c) if f.cancelled() else None)
        return fut

    def _withdraw(self, call_id: int) -> None:
        with self._calls_lock:
            if self._calls.pop(call_id, None) is None:
                return  # answered already
        try:
            self._post(("cancel", call_id))
        except EngineCoreDeadError:
            pass

    def _call(self, method: str, *args, timeout: float = 60.0):
        """``call_async``, waited for here (reading the pipe meanwhile when no other thread does)."""
        return self.wait_for(self.call_async(method, *args), timeout, method)

    def wait_for(self, fut: Future, timeout: float, what: str = "a call"):
        """The result of a ``call_async`` Future within ``timeout`` s (then it is withdrawn and
        TimeoutError raised)."""
        deadline = time.monotonic() + timeout
        while not fut.done():
            if time.monotonic() > deadline:
                fut.cancel()
                raise TimeoutError(f"the engine core did not answer {what} within {timeout:g} s")
            if self._recv_lock.acquire(blocking=False):  # nobody reads the pipe: read it here
                try:
                    outs = self._read(0.05)
                    if outs is not None:
                        self._pending.append(outs)
                finally:
                    self._recv_lock.release()
            else:
                futures_wait([fut], 0.05)
                self.check_alive()
        return fut.result()

    # ---- state ------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self._unfinished > 0 or bool(self._pending)

    def get_stats(self) -> SchedulerStats:
        return self._stats

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")

    def num_forward_tokens(self) -> int:
        return self._call("num_forward_tokens")

    def snapshot(self) -> dict:
        return self._call("snapshot")

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineCoreDeadError(self._dead)
        if self._closed:
            raise EngineCoreDeadError("the engine core was shut down")

    def idle_work(self, seconds: float) -> bool:
        return False  # the core's process does its own while it idles

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        if self._dead is None and self.proc.is_alive():
            try:
                _send(self._in_w, self._send_lock, ("shutdown",))
            except (OSError, EOFError):
                pass
        self._reap(timeout)

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid


def make_engine_core_client(config, hf_config, tokenizer, eos_token_ids, skip_tokenizer_init: bool,
                            multiprocess: bool, executor_factory=None) -> EngineCoreClient:
    """``executor_factory``: EngineCore's (picklable, for a core in its own process)."""
    if multiprocess:
        return MultiprocClient(config, skip_tokenizer_init, executor_factory)
    from pagedllm.engine.core import EngineCore

    return InprocClient(EngineCore(config, hf_config, tokenizer, eos_token_ids, executor_factory))


def core_in_own_process(config, server: bool) -> bool:
    """Whether the engine core runs in a process of its own: EngineConfig.engine_core_process, or
    by default yes for the server (AsyncLLM) and no offline (LLM)."""
    return server if config.engine_core_process is None else config.engine_core_process
