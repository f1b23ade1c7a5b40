"""The engine-core process: an EngineCore and its busy loop (started by core_client.MultiprocClient).

Each turn it takes every message waiting on its input pipe (requests, aborts, calls, shutdown),
then runs one step if anything is unfinished and sends the step's EngineCoreOutputs (with the
scheduler's statistics and the step's phase timings) up the output pipe -- written by a thread
of its own, so the loop never waits on a full pipe (the front end may be waiting on ours). Idle, it blocks on the
pipe. It exits when told to, when its input pipe closes (the front end died), or on SIGTERM
(default action); SIGINT is ignored so a terminal's Ctrl-C reaches only the server, which then
shuts the core down in order. A step that raises past the core's own failure isolation (e.g. a
tensor-parallel rank died) is reported as ("dead", reason) before the process exits 1.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
from concurrent.futures import CancelledError, Future
from typing import Optional

from pagedllm.core.grammar_wait import no_tokenizer_for_structured_outputs

logger = logging.getLogger(__name__)


def _load(config, skip_tokenizer_init: bool, executor_factory):
    from pagedllm.engine.core import EngineCore
    from pagedllm.engine.input_processor import eos_token_ids
    from pagedllm.models.config_json import load_hf_config
    from pagedllm.models.gguf import metadata_dir
    from pagedllm.tokenizer.tokenizer import load_tokenizer

    hf_config = load_hf_config(config.model)
    tokenizer = None if skip_tokenizer_init else load_tokenizer(metadata_dir(config.tokenizer or config.model))
    eos = eos_token_ids(metadata_dir(config.model), hf_config, tokenizer)
    return EngineCore(config, hf_config, tokenizer, eos, executor_factory)


class _CoreLoop:
    def __init__(self, core, conn_in, conn_out) -> None:
        self.core, self.conn_in, self.conn_out = core, conn_in, conn_out
        self.running = True
        self.num_unfinished = 0
        self._async: dict[int, Future] = {}  # asynchronous calls running, by call id
        # Outputs go out on a thread of their own: were this loop to block writing to a full
        # output pipe while the front end blocks writing requests to a full input pipe (its one
        # engine thread both sends and reads), neither would ever read again.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._write_error: Optional[BaseException] = None
        self._writer = threading.Thread(target=self._write_loop, name="pagedllm-core-output", daemon=True)
        self._writer.start()

    def _write_loop(self) -> None:
        while True:
            data = self._outbox.get()
            if data is None:
                return
            try:
                self.conn_out.send_bytes(data)
            except (OSError, EOFError, ValueError) as e:  # the front end is gone
                self._write_error = e
                return

    def send(self, msg) -> None:
        """Queue ``msg`` for the front end (pickled now, written by the output thread)."""
        if self._write_error is not None:
            raise BrokenPipeError(f"the front end is gone ({self._write_error!r})")
        self._outbox.put(pickle.dumps(msg, protocol=5))

    def close_output(self, timeout: float = 5.0) -> None:
        """Write what is queued (at most ``timeout`` seconds), then stop the output thread."""
        self._outbox.put(None)
        self._writer.join(timeout)

    def _reply(self, call_id: int, ok: bool, value) -> None:
        try:
            self.send(("reply", call_id, (ok, value)))
        except BrokenPipeError:
            raise
        except Exception:  # e.g. an exception that does not pickle: its text goes
            self.send(("reply", call_id, (False, RuntimeError(f"{type(value).__name__}: {value}"))))

    def _answer(self, call_id: int, fut: Future) -> None:
        """An asynchronous call ended (on its own thread): (True, None) -- what it made stays in
        the core -- or its exception."""
        self._async.pop(call_id, None)
        try:
            error = CancelledError() if fut.cancelled() else fut.exception()
            self._reply(call_id, error is None, error)
        except (OSError, EOFError, ValueError):  # the front end is gone (BrokenPipeError); the loop sees it too
            pass

    def handle(self, msg) -> list:
        """Apply one message; the outputs it produced at once (aborted beam groups, refusals)."""
        from pagedllm.core.contracts import EngineCoreOutput

        kind = msg[0]
        if kind == "add":
            req = msg[1]
            try:
                self.core.add_request(req)
            except Exception as e:  # validated by the front end: this is a bug, fail only this request
                logger.exception("engine core: request %s could not be added: %s", req.request_id, e)
                return [EngineCoreOutput(cid, [], finish_reason="error") for cid in req.child_ids]
            return []
        if kind == "abort":
            from pagedllm.engine.core import finish_status

            _, ids, reason = msg
            return self.core.abort_requests(ids, finish_status(reason))
        if kind == "call":
            _, call_id, method, args = msg
            try:
                value = getattr(self, "_call_" + method)(*args)
            except Exception as e:
                self._reply(call_id, False, e)
                return []
            if isinstance(value, Future):  # answered when it ends, from its thread
                self._async[call_id] = value
                value.add_done_callback(lambda f, c=call_id: self._answer(c, f))
            else:
                self._reply(call_id, True, value)
            return []
        if kind == "cancel":  # the caller withdrew (a client went away, a timeout)
            fut = self._async.get(msg[1])
            if fut is not None:
                fut.cancel()
            return []
        self.running = False  # "shutdown"
        return []

    def _call_reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def _call_num_forward_tokens(self) -> int:
        return self.core.executor.num_forward_tokens

    def _call_snapshot(self) -> dict:
        return self.core.snapshot()

    def _call_compile_structured_outputs(self, spec) -> Future:
        """Compile a request's constraint here, the one process that compiles (the front end
        checks only the limits): the compiled grammar stays in this process's cache for the
        request that follows; the front end learns only whether it compiled."""
        if self.core.structured is None:
            raise no_tokenizer_for_structured_outputs()
        return self.core.structured.manager.submit(spec)

    def _call_structured_stats(self) -> dict:
        return self.core.structured.manager.stats() if self.core.structured is not None else {}

    def run(self) -> None:
        from pagedllm.core.engine_request import EngineCoreOutputs

        from pagedllm.heap import IdleTrimmer

        core = self.core
        trimmer = IdleTrimmer()
        while self.running:
            if self._write_error is not None:
                raise BrokenPipeError(f"the front end is gone ({self._write_error!r})")
            busy = core.has_unfinished_requests()
            trimmer.busy() if busy else trimmer.idle()
            immediate: list = []
            handled = False
            # Block while idle (after the idle work, a slice at a time); while busy only take
            # what is already there.
            wait_s = 0.0 if busy or core.idle_work(IDLE_SLICE_S) else 1.0
            if self.conn_in.poll(wait_s):
                while self.running and self.conn_in.poll(0):
                    immediate.extend(self.handle(pickle.loads(self.conn_in.recv_bytes())))  # EOFError: the front end is gone
                    handled = True
            if not self.running:
                break
            if core.has_unfinished_requests():
                outputs = immediate + core.step()
                self.send(("outputs", EngineCoreOutputs(outputs, core.get_stats(), core.last_timing),
                           self._unfinished()))
            elif handled:  # statistics after aborts, or refused requests' errors
                self.send(("outputs", EngineCoreOutputs(immediate, core.get_stats()), self._unfinished()))

    def _unfinished(self) -> int:
        stats = self.core.get_stats()
        return stats.num_running + stats.num_waiting + int(self.core.has_unfinished_requests())


IDLE_SLICE_S = 0.002  # idle work between two looks at the input pipe (a request waits at most about this)


def run_engine_core(config, skip_tokenizer_init: bool, executor_factory, conn_in, conn_out,
                    log_level: int = logging.WARNING) -> None:
    """The process's entry point (``log_level``: the front end's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine-core] %(name)s: %(message)s")
    try:
        core = _load(config, skip_tokenizer_init, executor_factory)
    except BaseException as e:  # a start-up error: the front end raises it
        try:
            conn_out.send_bytes(pickle.dumps(("failed", e), protocol=5))
        except Exception:  # an exception that does not pickle
            conn_out.send_bytes(pickle.dumps(("failed", RuntimeError(f"{type(e).__name__}: {e}")), protocol=5))
        return
    from pagedllm.heap import freeze_startup_objects

    freeze_startup_objects()  # this process lives as long as its engine: full collections skip the start-up
    conn_out.send_bytes(pickle.dumps(("ready", {"limits": core.limits(), "stats": core.get_stats()}), protocol=5))
    loop = _CoreLoop(core, conn_in, conn_out)
    code = 0
    try:
        loop.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("engine core: the front end is gone; exiting")
    except BaseException as e:
        logger.exception("engine core: step failed; the core stops")
        try:
            loop.send(("dead", f"engine core failed: {e!r}"))
        except Exception:
            pass
        code = 1
    loop.close_output()
    try:
        core.shutdown()
    except Exception:
        logger.exception("engine core: shutdown failed")
    logging.shutdown()
    os._exit(code)
