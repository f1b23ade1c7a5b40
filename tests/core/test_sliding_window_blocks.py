"""Uniform sliding window: blocks whose keys every later query has left behind go back to the
pool while the request runs (Mistral-style configs), and nothing else about caching changes."""
from hypothesis import example, given, settings, strategies as st

from pagedllm.core.kv_cache_manager import OUT_OF_WINDOW, KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams
from scheduler_steps import fake_step


def make(num_blocks, block_size, window, budget=16, caching=True, max_model_len=4096):
    kv = KVCacheManager(num_blocks, block_size, caching, sliding_window=window)
    return Scheduler(SchedulerLimits(8, budget, max_model_len), kv), kv


def add(s, rid, n_prompt, max_tokens, base=0):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    s.add_request(Request(rid, [base + i for i in range(n_prompt)], sp, max_tokens=max_tokens))


def step(s):
    return fake_step(s)[0]


def live_blocks(kv, rid):
    return sum(1 for b in kv.req_blocks.get(rid, []) if b is not OUT_OF_WINDOW)


def test_a_long_sequence_holds_only_its_window():
    bs, window, budget = 4, 10, 8
    s, kv = make(num_blocks=12, block_size=bs, window=window, budget=budget)
    add(s, "long", 60, max_tokens=100)  # 160 tokens = 40 blocks, in a pool of 12
    peak = 0
    while s.has_unfinished_requests():
        step(s)
        peak = max(peak, live_blocks(kv, "long"))
        kv.pool.check_consistency()
    assert s.num_preemptions == 0
    assert peak <= -(-(budget + window - 1) // bs) + 1
    assert kv.num_free_blocks == kv.num_total_blocks


def test_freed_blocks_are_exactly_those_behind_the_window():
    bs, window = 4, 6
    s, kv = make(num_blocks=64, block_size=bs, window=window, budget=64)
    add(s, "r", 30, max_tokens=20)
    step(s)  # the whole prompt: next position 30, keys <= 24 are dead: blocks 0..5 (keys 0..23)
    req = s.requests["r"]
    first_new = req.num_computed_tokens
    blocks = kv.req_blocks["r"]
    step(s)  # allocate for position 30 frees what position 30 cannot see
    dead = (first_new - window + 1) // bs
    assert all(b is OUT_OF_WINDOW for b in blocks[:dead])
    assert all(b is not OUT_OF_WINDOW and b.ref_cnt == 1 for b in blocks[dead:])


def test_prefix_cache_still_hits_after_window_freeing():
    bs, window = 4, 8
    s, kv = make(num_blocks=64, block_size=bs, window=window, budget=64)
    add(s, "a", 40, max_tokens=8)
    while s.has_unfinished_requests():
        step(s)
    add(s, "b", 40, max_tokens=8)  # same prompt: the freed blocks kept their hashes
    so = s.schedule()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 36  # 9 full blocks hit (the last token is always computed)
    kv.pool.check_consistency()


def test_without_a_window_nothing_is_freed_early():
    s, kv = make(num_blocks=64, block_size=4, window=None, budget=64)
    add(s, "r", 40, max_tokens=8)
    step(s)
    step(s)
    assert live_blocks(kv, "r") == len(kv.req_blocks["r"]) == 11


@settings(max_examples=150, deadline=None)
# A block shared through the prefix cache frees nothing when the window leaves it.
@example(window=2, block_size=1, budget=3, prompts=[(1, 2), (1, 2), (2, 2)], extra_blocks=0, caching=True)
# A resumed request's hits behind the window are not taken (else they fill the pool).
@example(window=4, block_size=1, budget=4, prompts=[(1, 3), (9, 1)], extra_blocks=0, caching=True)
@given(
    window=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 8]), budget=st.integers(2, 24),
    prompts=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30)), min_size=1, max_size=5),
    extra_blocks=st.integers(0, 16), caching=st.booleans(),
)
def test_random_workloads_never_leak_and_respect_the_bound(window, block_size, budget, prompts, extra_blocks, caching):
    # The pool holds one sequence at its peak (what fit_max_model_len checks) plus some: any
    # prompt length runs, with preemption when several requests compete.
    bound = -(-(budget + window - 1) // block_size) + 1
    s, kv = make(bound + extra_blocks, block_size, window, budget=budget, caching=caching)
    for i, (n, m) in enumerate(prompts):
        add(s, f"r{i}", n, m, base=(i % 2) * 1000)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        step(s)
        kv.pool.check_consistency()
        for rid in kv.req_blocks:
            assert live_blocks(kv, rid) <= bound
    assert not s.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_total_blocks
