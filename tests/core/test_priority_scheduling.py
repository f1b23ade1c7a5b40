"""The "priority" scheduling policy (core/scheduling_policy.py): waiting and running requests in
(priority, arrival) order, lower first, and the preemption victim is always the running request
that ranks last; the FCFS policy is the default and unchanged."""
import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.config import SCHEDULING_POLICIES
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.core.scheduling_policy import POLICIES, PriorityPolicy, make_policy, priority_key
from pagedllm.sampling_params import SamplingParams
from scheduler_steps import fake_step


def make(policy="priority", num_blocks=64, block_size=4, max_num_seqs=8, budget=32, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerLimits(max_num_seqs, budget, 256, scheduling_policy=policy), kv)


def add(s, rid, n_prompt, priority, arrival, max_tokens=4, base=0):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    s.add_request(Request(rid, [base + i for i in range(n_prompt)], sp, max_tokens=max_tokens,
                          arrival_time=arrival, priority=priority))


def keys(reqs):
    return [priority_key(r) for r in reqs]


def test_registered_and_unknown_names_refused():
    assert set(POLICIES) == set(SCHEDULING_POLICIES) == {"fcfs", "priority"}  # the config validates these names
    assert isinstance(make_policy("priority"), PriorityPolicy)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_policy("lifo")


def test_lower_priority_value_is_admitted_first():
    s = make(max_num_seqs=1, budget=100)
    add(s, "late-urgent", 4, priority=-1, arrival=3.0)
    add(s, "early", 4, priority=0, arrival=1.0, base=100)
    add(s, "early-urgent", 4, priority=-1, arrival=2.0, base=200)
    order = []
    while s.has_unfinished_requests():
        so, _ = fake_step(s)
        order.extend(r.req_id for r in so.scheduled_new_reqs)
    assert order == ["early-urgent", "late-urgent", "early"]


def test_the_same_workload_under_fcfs_keeps_arrival_order():
    s = make(policy="fcfs", max_num_seqs=1, budget=100)
    add(s, "a", 4, priority=5, arrival=1.0)
    add(s, "b", 4, priority=-5, arrival=2.0, base=100)
    so, _ = fake_step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a"]


def test_urgent_request_is_never_the_victim_of_a_lesser_one():
    # 6 blocks of 4 tokens: three requests growing from 8 to 16 tokens cannot all fit.
    s = make(num_blocks=6, budget=64, caching=False)
    add(s, "urgent", 8, priority=0, arrival=3.0, max_tokens=8)
    add(s, "meh", 8, priority=1, arrival=1.0, max_tokens=8, base=100)
    add(s, "low", 8, priority=2, arrival=2.0, max_tokens=8, base=200)
    preempted = set()
    while s.has_unfinished_requests():
        so, _ = fake_step(s)
        preempted |= so.preempted_req_ids
    assert preempted and "urgent" not in preempted
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 24), st.integers(1, 10), st.integers(-2, 2), st.integers(0, 5)),
             min_size=1, max_size=12),
    st.integers(0, 16), st.sampled_from([1, 4]), st.integers(1, 6), st.booleans(), st.integers(0, 12),
)
def test_order_and_victim_invariants(reqs, num_blocks_extra, block_size, max_num_seqs, caching, late_at):
    """Every step: both queues sorted by (priority, arrival); every request preempted in the
    step ranks at or after every request still running; the scheduler drains without leaks.
    Half the requests arrive late (after ``late_at`` steps), so admission and preemption interleave."""
    num_blocks = -(-48 // block_size) + num_blocks_extra
    s = make(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, budget=16, caching=caching)
    early = [(i, r) for i, r in enumerate(reqs) if i % 2 == 0]
    late = [(i, r) for i, r in enumerate(reqs) if i % 2 == 1]

    def add_all(batch):
        for i, (plen, mt, prio, arrival) in batch:
            add(s, f"r{i}", plen, priority=prio, arrival=float(arrival), max_tokens=mt, base=i * 1000)

    add_all(early)
    steps = 0
    while s.has_unfinished_requests() or late:
        if steps == late_at or not s.has_unfinished_requests():
            add_all(late)
            late = []
        so, _ = fake_step(s)
        steps += 1
        assert keys(s.waiting) == sorted(keys(s.waiting))
        assert keys(s.running) == sorted(keys(s.running))
        victims = [s.requests[r] for r in so.preempted_req_ids if r in s.requests]
        if victims and s.running:
            assert min(keys(victims)) >= max(keys(s.running))
        assert all(r.status == RequestStatus.RUNNING for r in s.running)
        s.kv.pool.check_consistency()
        assert len(s.running) <= max_num_seqs and steps < 5000
    assert s.kv.num_free_blocks == s.kv.num_total_blocks and not s.requests


def test_engine_config_refuses_an_unknown_policy(tmp_path):
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(model=str(tmp_path), scheduling_policy="lifo")
