"""Scheduler without a model: hand-made runner outputs drive update_from_output."""
from hypothesis import given, settings, strategies as st

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams
from scheduler_steps import fake_step


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerLimits(max_num_seqs, budget, max_model_len), kv)


def add(s, rid, n_prompt, max_tokens=4, base=0):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    s.add_request(Request(rid, [base + i for i in range(n_prompt)], sp, max_tokens=max_tokens))




def run_to_end(s, max_steps=10_000):
    finished = {}
    steps = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        so, outs = fake_step(s)
        steps.append(so)
        for o in outs:
            if o.finish_reason:
                finished[o.req_id] = o.finish_reason
    assert not s.has_unfinished_requests(), "scheduler did not drain"
    return finished, steps


def test_chunked_prefill_mixes_with_decode():
    s = make_scheduler(budget=10)
    add(s, "short", 3, max_tokens=5)
    so, _ = fake_step(s)
    assert so.num_scheduled_tokens == {"short": 3}
    add(s, "long", 25)
    so, _ = fake_step(s)
    # the decode goes first, the long prompt takes the rest of the budget
    assert so.num_scheduled_tokens == {"short": 1, "long": 9}
    so, _ = fake_step(s)
    assert so.num_scheduled_tokens == {"short": 1, "long": 9}
    finished, _ = run_to_end(s)
    assert finished == {"short": "length", "long": "length"}
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(5):
        add(s, f"r{i}", 4, base=i * 100)
    so, _ = fake_step(s)
    assert len(so.num_scheduled_tokens) == 2
    finished, steps = run_to_end(s)
    assert len(finished) == 5
    assert all(len(x.num_scheduled_tokens) <= 2 for x in steps)


def test_preempts_most_recent_and_recovers():
    # 6 blocks of 4 tokens; three requests of 8 prompt tokens growing to 16 cannot all fit.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    for i in range(3):
        add(s, f"r{i}", 8, max_tokens=8, base=i * 100)
    finished, steps = run_to_end(s)
    assert finished == {f"r{i}": "length" for i in range(3)}
    assert s.num_preemptions > 0
    assert any("r2" in so.preempted_req_ids or "r1" in so.preempted_req_ids for so in steps)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_abort_frees_blocks_and_tells_workers():
    s = make_scheduler()
    add(s, "a", 10)
    add(s, "b", 10, base=50)
    fake_step(s)
    used = s.kv.num_total_blocks - s.kv.num_free_blocks
    assert used > 0
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    so, _ = fake_step(s)
    assert "a" in so.finished_req_ids
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    assert not s.has_unfinished_requests()


def test_prefix_cache_hit_skips_computation():
    s = make_scheduler(block_size=4, budget=100)
    add(s, "a", 20)
    run_to_end(s)
    add(s, "b", 20)
    so, _ = fake_step(s)
    assert so.num_scheduled_tokens["b"] == 4  # 16 of 20 tokens (4 blocks) came from the cache
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=12),
    st.integers(8, 40), st.sampled_from([1, 4, 8]), st.integers(1, 6), st.booleans(), st.integers(0, 10),
)
def test_random_workloads_drain_without_leaks(reqs, num_blocks_extra, block_size, max_num_seqs, caching, abort_at):
    max_model_len = 48
    num_blocks = -(-max_model_len // block_size) + num_blocks_extra
    s = make_scheduler(num_blocks, block_size, max_num_seqs, budget=16, max_model_len=max_model_len, caching=caching)
    for i, (plen, mt, prefix) in enumerate(reqs):
        add(s, f"r{i}", plen, max_tokens=mt, base=prefix * 1000)
    steps = 0
    while s.has_unfinished_requests():
        fake_step(s)
        steps += 1
        if steps == abort_at:
            s.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
        s.kv.pool.check_consistency()
        assert len(s.running) <= max_num_seqs
        assert steps < 5000
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def add_children(s, parent, n, n_prompt, max_tokens=4):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        s.add_request(Request(f"{parent}#{i}", list(range(n_prompt)), sp, max_tokens=max_tokens, parent_id=parent))


def test_one_requests_children_hold_at_most_their_share_of_the_slots():
    kv = KVCacheManager(256, 4, True)
    s = Scheduler(SchedulerLimits(8, 256, 256, max_num_seqs_per_request=3), kv)
    add_children(s, "big", 12, 5, max_tokens=30)
    so, _ = fake_step(s)
    assert len(so.num_scheduled_tokens) == 3  # 3 of its 12 run; 5 slots stay free for others
    add(s, "late", 4, max_tokens=2, base=900)
    so, _ = fake_step(s)
    assert "late" in so.num_scheduled_tokens  # admitted at once, past the waiting children
    finished, steps = run_to_end(s)
    assert len(finished) == 13
    for step in steps:
        assert sum(rid.startswith("big#") for rid in step.num_scheduled_tokens) <= 3
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 12), st.integers(1, 8)), min_size=1, max_size=6),
       st.integers(1, 4), st.integers(2, 8), st.integers(16, 40), st.integers(0, 12))
def test_shares_hold_through_preemption_and_aborts(parents, share, max_num_seqs, num_blocks, abort_at):
    """With preemption (a small cache) and an abort, no request ever runs more than its share,
    every child finishes and no block or slot is leaked."""
    kv = KVCacheManager(num_blocks, 4, True)
    s = Scheduler(SchedulerLimits(max_num_seqs, 16, 48, max_num_seqs_per_request=share), kv)
    for p, (n, plen, mt) in enumerate(parents):
        add_children(s, f"p{p}", n, plen, max_tokens=mt)
    steps = 0
    while s.has_unfinished_requests():
        fake_step(s)
        steps += 1
        if steps == abort_at:
            s.finish_requests(["p0#0"], RequestStatus.FINISHED_ABORTED)
        per_parent = {}
        for r in s.running:
            per_parent[r.parent_id] = per_parent.get(r.parent_id, 0) + 1
        assert max(per_parent.values(), default=0) <= share
        assert steps < 5000
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    share_constraint = next((c for c in s.constraints if type(c).__name__ == "RequestShare"), None)
    assert (share_constraint is None) == (share >= max_num_seqs)  # a share of every slot is no constraint
    assert share_constraint is None or not share_constraint._running
