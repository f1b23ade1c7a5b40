"""pagedllm/heap.py: the heap is trimmed once per idle stretch that follows work (issue 29's RSS
gate: a server returns toward its resting size after a burst)."""
import pytest

from pagedllm import heap


def test_the_idle_trimmer_trims_once_per_idle_stretch_after_work(monkeypatch):
    calls, now = [], [0.0]
    monkeypatch.setattr(heap, "collect_and_trim", lambda: calls.append(now[0]) or True)
    t = heap.IdleTrimmer(5.0, clock=lambda: now[0])
    for now[0] in (0.0, 10.0, 20.0):  # idle without having worked: nothing to give back
        t.idle()
    t.busy()
    for now[0] in (21.0, 25.9):
        t.idle()
    assert calls == []
    for now[0] in (26.0, 40.0, 60.0):
        t.idle()
    assert calls == [26.0]
    t.busy()
    for now[0] in (61.0, 62.0):  # work again restarts the stretch
        t.idle()
    t.busy()
    for now[0] in (63.0, 68.0):
        t.idle()
    assert calls == [26.0, 68.0]


def test_trim_freed_memory_runs_here():
    assert heap.trim_freed_memory() in (True, False)  # glibc here: True; elsewhere a no-op


def test_freeze_startup_objects_moves_what_lives_into_the_permanent_generation():
    import subprocess
    import sys

    code = ("import gc; from pagedllm import heap; assert gc.get_freeze_count() == 0; "
            "heap.freeze_startup_objects(); print(gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout) > 1000  # the interpreter's and pagedllm's modules, functions, classes


def test_the_server_calls_on_ready_once_its_engine_serves(llama_ckpt):
    """run_server sets ``on_ready = freeze_startup_objects``; here a recorder stands in (freezing
    this test process would keep every later test's garbage)."""
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import ServerState, build_app
    from tests.entrypoints.conftest import ENGINE_KW, LiveServer, wait_ready

    calls = []
    state = ServerState(EngineConfig(model=llama_ckpt, **ENGINE_KW), "tiny")
    state.on_ready = lambda: calls.append(state.serving is not None)
    live = wait_ready(LiveServer(build_app(None, state=state)))
    try:
        assert calls == [True]  # after the handlers exist, once
    finally:
        live.stop()


def test_collect_and_trim_frees_cyclic_garbage_first():
    import gc
    import weakref

    class Body:  # a parsed request body kept alive only by a reference cycle
        pass

    body = Body()
    body.me = body
    alive = weakref.ref(body)
    del body
    gc.disable()  # nothing else may collect it in between
    try:
        assert alive() is not None
        assert heap.collect_and_trim() in (True, False)
        assert alive() is None
    finally:
        gc.enable()


def test_old_objects_frozen_only_while_the_loop_runs():
    import gc

    from pagedllm.heap import old_objects_frozen

    if gc.get_freeze_count():
        pytest.skip("an earlier test in this process froze objects for good (a server's start-up)")
    before = [object() for _ in range(3)]  # noqa: F841 - alive across the block
    with old_objects_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        cycle = []
        cycle.append(cycle)  # made inside: still collectable while the loop runs
        del cycle
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0  # everything collectable again afterwards


def test_old_objects_frozen_leaves_someone_elses_freeze_alone(monkeypatch):
    import gc

    from pagedllm.heap import old_objects_frozen

    calls = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 1000)  # someone froze objects before us
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    with old_objects_frozen():
        pass
    assert calls == []  # neither frozen again nor, above all, unfrozen
