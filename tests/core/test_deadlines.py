"""Deadlines carried into the core (core/deadlines.py): a request past its deadline is ended by the
scheduler itself, wherever it is (waiting, running, preempted), its blocks freed and its caller
told ("abort"); requests without one, or with a later one, are untouched."""
import time

from hypothesis import given, settings, strategies as st

from pagedllm.core.deadlines import DeadlineWatch
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams
from scheduler_steps import fake_step


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=32):
    return Scheduler(SchedulerLimits(max_num_seqs, budget, 256), KVCacheManager(num_blocks, 4, True))


def add(s, rid, n_prompt=6, max_tokens=50, deadline=None, base=0):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    s.add_request(Request(rid, [base + i for i in range(n_prompt)], sp, max_tokens=max_tokens, deadline=deadline))


def test_waiting_request_past_its_deadline_never_runs():
    s = make_scheduler()
    add(s, "late", deadline=time.monotonic() - 1)
    add(s, "ok", base=100)
    so, outs = fake_step(s)
    assert set(so.num_scheduled_tokens) == {"ok"}
    (ended,) = s.take_failed()
    assert (ended.req_id, ended.new_token_ids, ended.finish_reason) == ("late", [], "abort")
    assert "late" not in s.requests and s.num_expired == 1
    assert not s.take_failed()  # told once


def test_running_request_ends_at_its_deadline_and_frees_its_blocks():
    s = make_scheduler()
    soon = time.monotonic() + 0.2
    add(s, "timed", deadline=soon)
    add(s, "free", base=100)
    add(s, "later", deadline=soon + 3600, base=200)
    for _ in range(3):
        fake_step(s)
    assert {"timed", "free", "later"} <= set(s.requests)
    assert s.kv.get_block_ids("timed")
    time.sleep(max(0.0, soon - time.monotonic()) + 0.01)
    so, _ = fake_step(s)
    assert "timed" in so.finished_req_ids  # the workers forget it with this step
    assert set(so.num_scheduled_tokens) == {"free", "later"}
    assert [(o.req_id, o.finish_reason) for o in s.take_failed()] == [("timed", "abort")]
    assert s.kv.get_block_ids("timed") == []
    others = len(s.kv.get_block_ids("free")) + len(s.kv.get_block_ids("later"))
    assert s.kv.num_free_blocks == s.kv.num_total_blocks - others
    s.finish_requests(["free", "later"], s.requests["free"].status.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_preempted_request_expires_too():
    s = make_scheduler(num_blocks=6, budget=64)
    soon = time.monotonic() + 0.3
    add(s, "a", n_prompt=8, max_tokens=8, deadline=soon)
    add(s, "b", n_prompt=8, max_tokens=8, deadline=soon, base=100)
    add(s, "c", n_prompt=8, max_tokens=8, deadline=soon, base=200)
    for _ in range(6):  # 3 x 16 tokens cannot fit 6 blocks of 4: someone is preempted
        fake_step(s)
    assert s.num_preemptions > 0
    time.sleep(max(0.0, soon - time.monotonic()) + 0.01)
    left = set(s.requests)
    fake_step(s)
    assert {o.req_id for o in s.take_failed()} == left
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == s.kv.num_total_blocks


def test_a_request_finished_before_its_deadline_is_not_told_again():
    s = make_scheduler()
    soon = time.monotonic() + 0.2
    add(s, "quick", max_tokens=2, deadline=soon)
    while s.has_unfinished_requests():
        fake_step(s)
    time.sleep(max(0.0, soon - time.monotonic()) + 0.01)
    fake_step(s)
    assert not s.take_failed() and s.num_expired == 0 and not len(s.deadlines)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.booleans()), max_size=30), st.floats(0, 100))
def test_watch_gives_exactly_the_live_expired(entries, now):
    w = DeadlineWatch()
    for i, (d, _) in enumerate(entries):
        w.add(f"r{i}", d)
    live = {f"r{i}" for i, (_, alive) in enumerate(entries) if alive}
    got = w.expired(now, live.__contains__)
    want = [f"r{i}" for i, (d, alive) in sorted(enumerate(entries), key=lambda e: (e[1][0], f"r{e[0]}")) if alive and d <= now]
    assert got == want
    assert len(w) == sum(d > now for d, _ in entries)
    assert w.expired(now, live.__contains__) == []
