"""pagedllm/heap.py: the heap is trimmed once per idle stretch that follows work (issue 29's RSS
gate: a server returns toward its resting size after a burst)."""
from pagedllm import heap


def test_the_idle_trimmer_trims_once_per_idle_stretch_after_work(monkeypatch):
    calls, now = [], [0.0]
    monkeypatch.setattr(heap, "trim_freed_memory", lambda: calls.append(now[0]) or True)
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
