"""Grammar compiles in worker processes of their own (issue 29), so a compile can really be stopped.

An xgrammar compile is C++ that cannot be interrupted on a thread: a compile past
``structured_compile_timeout`` would run on after its request got its 408. Here each compile
runs in a worker process (a fresh interpreter) that holds only xgrammar and the tokenizer's vocabulary
(``TokenizerInfo``, sent as JSON); the compiled grammar comes back serialized and is
deserialized in the engine core against its own TokenizerInfo. The parent waits on the worker
and kills it (SIGKILL) when the compile runs past its deadline or when no request waits for it
any more; the next compile starts a fresh worker. Its heap is capped (``RLIMIT_DATA`` at what
the imports took plus ``memory_limit`` bytes), so a grammar that needs more memory fails that
request with a 400 instead of growing the engine, and a worker whose resident memory grew by
more than ``recycle_bytes`` is retired after its compile (what it allocated goes back to the
operating system with it: glibc keeps a thread's freed arenas).
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from pagedllm.structured_output.limits import CompilePoolFullError

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting parent looks at the deadline and at whether anyone still waits


class CompileStopped(CompilePoolFullError):
    """The compile was stopped because nobody waited for it any more (its worker was killed); a
    caller that joined it meanwhile may retry (HTTP 429)."""


class CompileDeadlineError(Exception):
    """The compile ran past its deadline; its worker was killed. (Not a TimeoutError: that is an
    OSError, which a dead worker's pipe raises.)"""


def _status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def make_compiler(info_json: str):
    """An xgrammar GrammarCompiler for the vocabulary in ``info_json`` (TokenizerInfo JSON)."""
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1, cache_enabled=False)


def _serve(conn_in, conn_out, compile_fn=None, compiler_factory=None) -> None:
    """The worker's loop: the tokenizer info (JSON) and the heap budget first, then compile each
    (kind, text) key sent, answering ("ok", serialized grammar), ("error", message) or
    ("memory", None); it ends when its input pipe closes. ``compile_fn(compiler, key)``
    (grammars.compile_with) and ``compiler_factory(info_json)`` (make_compiler): a test's worker
    may replace them."""
    import resource

    if compile_fn is None:
        from pagedllm.structured_output.grammars import compile_with as compile_fn
    info_json, memory_limit = pickle.loads(conn_in.recv_bytes())
    compiler = (compiler_factory or make_compiler)(info_json)
    del info_json
    if memory_limit > 0:  # the heap as it is now (imports, vocabulary) plus the budget for compiles
        cap = _status_kib(os.getpid(), "VmData") * 1024 + memory_limit
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    conn_out.send_bytes(b"ready")
    while True:
        try:
            key = pickle.loads(conn_in.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", compile_fn(compiler, key).serialize_json())
        except MemoryError:
            reply = ("memory", None)
        except ValueError as e:
            reply = ("error", str(e))
        conn_out.send_bytes(pickle.dumps(reply, protocol=5))


def worker_main(argv: list[str], compile_fn=None, compiler_factory=None) -> None:
    """``python -m pagedllm.structured_output.compile_process IN_FD OUT_FD``: a worker."""
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    parent = os.getppid()
    try:  # die with the thread that started it (PR_SET_PDEATHSIG), even in the middle of a compile
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the signal was armed
        return
    _serve(Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False), compile_fn,
           compiler_factory)


WORKER_MODULE = "pagedllm.structured_output.compile_process"


class CompileProcess:
    """One compile worker: ``python -m <module>`` (a fresh interpreter: nothing of the engine's
    process is inherited, and no __main__ is re-imported as a spawned multiprocessing child
    would), started on first use and again after it was killed or retired."""

    start_timeout = 120.0

    def __init__(self, tokenizer_info_json: str, memory_limit: int, recycle_bytes: int,
                 module: str = WORKER_MODULE) -> None:
        self._info = tokenizer_info_json
        self.memory_limit = memory_limit
        self.recycle_bytes = recycle_bytes
        self.module = module
        self._proc: Optional[subprocess.Popen] = None
        self._to = self._from = None
        self._base_rss_kib = 0
        self.num_started = 0
        self.last_pid: Optional[int] = None  # the latest worker's, also after it was stopped
        self.idle_since = 0.0  # when it last finished a compile (WorkerPool retires idle workers)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        from multiprocessing.connection import Connection

        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in sys.path if p], env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", self.module, str(to_r), str(from_w)],
                                          pass_fds=(to_r, from_w), env=env, stdin=subprocess.DEVNULL,
                                          close_fds=True)
        finally:
            os.close(to_r)
            os.close(from_w)
        self._to, self._from = Connection(to_w, readable=False), Connection(from_r, writable=False)
        self.num_started += 1
        self.last_pid = self._proc.pid
        self._to.send_bytes(pickle.dumps((self._info, self.memory_limit), protocol=5))
        if not self._from.poll(self.start_timeout) or self._from.recv_bytes() != b"ready":
            self.stop()
            raise RuntimeError("the grammar compile worker process did not start")
        self._base_rss_kib = _status_kib(self._proc.pid, "VmRSS")

    def compile(self, key: tuple[str, str], timeout: float, abandoned: Callable[[], bool]) -> str:
        """``key``'s compiled grammar, serialized (CompiledGrammar.serialize_json). ValueError when
        it does not compile or needs more than ``memory_limit``; CompileDeadlineError when it runs
        longer than ``timeout`` seconds (counted from when the worker has it); CompileStopped
        once ``abandoned()``. Either way the worker is killed."""
        if self._proc is None or self._proc.poll() is not None:
            self.stop()
            self._start()
        if abandoned():  # while it started: it stays up for the next compile
            raise CompileStopped("the compile was withdrawn before it started; retry")
        try:
            self._to.send_bytes(pickle.dumps(key, protocol=5))
            deadline = time.monotonic() + timeout
            while not self._from.poll(_POLL_S):
                if abandoned():
                    self.stop()
                    raise CompileStopped("the compile was stopped: nobody waits for it any more; retry")
                if time.monotonic() > deadline:
                    self.stop()
                    raise CompileDeadlineError()
            status, value = pickle.loads(self._from.recv_bytes())
        except (EOFError, OSError):  # the worker died: its heap cap, or killed from outside
            self.stop()
            return self._memory_error(key)
        if status == "memory":
            self.stop()
            return self._memory_error(key)
        if self.recycle_bytes and (_status_kib(self._proc.pid, "VmRSS") - self._base_rss_kib) * 1024 > self.recycle_bytes:
            self.stop()  # what it grew by goes back to the system
        if status == "error":
            raise ValueError(value)
        return value

    def _memory_error(self, key) -> str:
        raise ValueError(f"structured_outputs.{key[0]}: compiling it needs more than the {self.memory_limit >> 20} MiB "
                         "a compile may use (structured_compile_memory)")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        for c in (self._to, self._from):
            if c is not None:
                c.close()
        self._to = self._from = None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                logger.warning("grammar compile worker %d did not exit after SIGKILL", proc.pid)


class WorkerPool:
    """The compile workers for one vocabulary (TokenizerInfo JSON) and one set of limits, shared
    by every GrammarBackend of this process that has them (engines built one after another in a
    process reuse warm workers). A compile takes an idle worker or makes one; a worker idle for
    ``idle_s`` is stopped (its memory goes back; the next compile starts it again)."""

    def __init__(self, info_json: str, memory_limit: int, recycle_bytes: int, module: str, idle_s: float) -> None:
        self._args = (info_json, memory_limit, recycle_bytes, module)
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[CompileProcess] = []
        self.workers: list[CompileProcess] = []  # every one made (for tests and stats)

    def compile(self, key: tuple[str, str], timeout: float, abandoned: Callable[[], bool]) -> str:
        with self._lock:
            if self._idle:
                worker = self._idle.pop()
            else:
                worker = CompileProcess(*self._args)
                self.workers.append(worker)
        try:
            return worker.compile(key, timeout, abandoned)
        finally:
            with self._lock:
                self._idle.append(worker)
                stamp = worker.idle_since = time.monotonic()
            timer = threading.Timer(self.idle_s, self._retire_if_idle, (worker, stamp))
            timer.daemon = True
            timer.start()

    def _retire_if_idle(self, worker: CompileProcess, stamp: float) -> None:
        with self._lock:
            if worker in self._idle and worker.idle_since == stamp:
                worker.stop()

    def stop_idle(self) -> None:
        """Stop the workers not compiling now (a later compile starts them again)."""
        with self._lock:
            for worker in self._idle:
                worker.stop()


_POOLS: dict[tuple, WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def worker_pool(info_json: str, memory_limit: int, recycle_bytes: int, module: str = WORKER_MODULE,
                idle_s: float = 30.0) -> WorkerPool:
    """This process's WorkerPool for these settings (made on first use)."""
    key = (hashlib.sha256(info_json.encode("utf-8", "surrogatepass")).hexdigest(), memory_limit, recycle_bytes,
           module, idle_s)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = WorkerPool(info_json, memory_limit, recycle_bytes, module, idle_s)
        return pool


if __name__ == "__main__":
    worker_main(sys.argv[1:])
