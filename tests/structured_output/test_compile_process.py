"""Grammar compiles in worker processes (issue 29): the compiled grammar comes back and masks
tokens exactly as one compiled here does; a compile past its timeout, or that nobody waits for any
more, is really stopped (its worker process is killed; the next compile starts a fresh one); a
compile that needs more memory than structured_compile_memory fails with a ValueError naming it."""
import os
import threading
import time

import pytest

xgr = pytest.importorskip("xgrammar")

from pagedllm.sampling_params import StructuredOutputsParams as S  # noqa: E402
from pagedllm.structured_output.backend import CompileIsolation, GrammarBackend, spec_key  # noqa: E402
from pagedllm.structured_output.compile_process import (  # noqa: E402
    CompileDeadlineError, CompileProcess, CompileStopped, worker_pool)
from pagedllm.structured_output.limits import CompileLimits, CompileTimeoutError  # noqa: E402
from pagedllm.structured_output.manager import StructuredOutputManager  # noqa: E402
from pagedllm.tokenizer.tokenizer import load_tokenizer  # noqa: E402

REGEX = S(regex="(ab|c[d-f]){2,4}x")
FAULTS = "compile_worker_faults"  # tests/structured_output/compile_worker_faults.py


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return load_tokenizer(default_model)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_worker_compile_masks_like_one_compiled_here(tokenizer):
    backend = GrammarBackend(tokenizer, 1024, [0], isolation=CompileIsolation())
    try:
        key = spec_key(REGEX)
        far = backend.compile_key(key, timeout=120)  # in a worker: a regex is never compiled inline
        pool = backend._pool  # this process's workers for this vocabulary (shared by its backends)
        assert any(w.pid is not None for w in pool.workers)
        near = backend._compile(key)
        mf, mn = backend.matcher(far), backend.matcher(near)
        steps = 0
        while steps < 12:
            bf, bn = backend.allocate_bitmask(1), backend.allocate_bitmask(1)
            mf.fill_next_token_bitmask(bf)
            mn.fill_next_token_bitmask(bn)
            assert bf.equal(bn)
            allowed = [i for i in range(1, 1024) if (int(bn[0, i // 32]) >> (i % 32)) & 1]  # 0: the stop token
            if not allowed:
                break
            tok = allowed[len(allowed) // 2]
            assert mf.accept_token(tok) and mn.accept_token(tok)
            steps += 1
        assert steps >= 3  # "(ab|c[d-f]){2,4}x" takes at least three tokens
    finally:
        backend.shutdown()
    assert all(w.pid is None and _gone(w.last_pid) for w in pool.workers)  # idle ones stopped


def test_a_compile_is_stopped_past_its_timeout_or_when_abandoned_and_its_memory_is_capped(tokenizer):
    backend = GrammarBackend(tokenizer, 1024, [0])
    worker = CompileProcess(backend.tokenizer_info.serialize_json(), 256 << 20, 0, module=FAULTS)
    try:
        with pytest.raises(ValueError, match="structured_compile_memory"):
            worker.compile(("grammar", "ALLOC"), 120, lambda: False)
        first = worker.last_pid
        with pytest.raises(CompileDeadlineError):
            worker.compile(("grammar", "SLEEP"), 0.5, lambda: False)
        second = worker.last_pid
        assert second != first and _gone(second)  # killed, not left running
        assert worker.compile(("grammar", "FAST"), 120, lambda: False) == "{}"  # a fresh worker answers
        third = worker.last_pid
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        with pytest.raises(CompileStopped):
            worker.compile(("grammar", "SLEEP"), 3600, stop.is_set)
        assert third != second and _gone(third) and worker.num_started == 3
    finally:
        worker.stop()


def test_the_manager_stops_a_compile_nobody_waits_for(tokenizer):
    """The caller's timeout (a 408 in the server) withdraws it; the worker is killed, the slot freed."""
    iso = CompileIsolation(worker_module=FAULTS)
    m = StructuredOutputManager(tokenizer, 1024, [0], CompileLimits(timeout=1.0), iso)
    try:  # the backend's pool (this process's, for its vocabulary), its worker up before the clock starts
        pool = worker_pool(m.backend.tokenizer_info.serialize_json(), iso.memory_limit, iso.recycle_bytes, FAULTS,
                           iso.idle_s)
        assert pool.compile(("grammar", "FAST"), 120, lambda: False) == "{}"
        worker = pool.workers[0]
        pid = worker.pid
        with pytest.raises(CompileTimeoutError):
            m.validate(S(grammar="SLEEP"))
        assert m.backend._pool is pool
        deadline = time.monotonic() + 60
        while (m.num_inflight_compiles or worker.pid is not None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m.num_inflight_compiles == 0 and worker.pid is None and _gone(pid)
    finally:
        m.shutdown()
