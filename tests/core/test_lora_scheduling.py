"""LoRA in the scheduler, without a model: adapter slots (pins, LRU replacement, loads sent to the
workers), requests waiting for a slot while others run, the per-step adapter cap, and block
hashes keyed by the adapter's identity."""
from pagedllm.core.contracts import LoRAHandle
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.lora_slots import AdapterSlots
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams
from scheduler_steps import fake_step

A, B, C = (LoRAHandle(n, f"{n}:digest-{n}", f"/adapters/{n}") for n in "abc")


def make(max_loras=2, per_step=0, max_num_seqs=8, budget=64):
    kv = KVCacheManager(64, 4, True)
    return Scheduler(SchedulerLimits(max_num_seqs, budget, 256, max_loras=max_loras, max_loras_per_step=per_step), kv)


def add(s, rid, lora, n_prompt=6, max_tokens=3):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    s.add_request(Request(rid, list(range(10, 10 + n_prompt)), sp, max_tokens=max_tokens, lora=lora))


def step(s):
    return fake_step(s)[0]


def adapters_of(s, so):
    return {r.lora.key for r in (s.requests.get(rid) for rid in so.num_scheduled_tokens) if r and r.lora}


def test_slots_pin_and_replace_least_recently_used():
    slots = AdapterSlots(2)
    assert slots.acquire(A) == 0 and slots.acquire(B) == 1
    assert slots.take_loads() == ((0, A), (1, B))
    assert slots.acquire(C) is None  # both pinned
    slots.release(0)
    assert slots.acquire(A) == 0 and slots.take_loads() == ()  # still loaded: no reload
    slots.release(0)
    slots.release(1)
    slots.acquire(B)  # B used more recently than A
    slots.release(1)
    assert slots.acquire(C) == 0  # A is the least recently used unpinned adapter
    assert slots.take_loads() == ((0, C),)


def test_request_waits_for_a_slot_while_others_run():
    s = make(max_loras=1)
    add(s, "a1", A)
    add(s, "b1", B)  # no slot while a1 runs
    add(s, "base", None)  # admitted past the waiting b1
    so = step(s)
    assert set(so.num_scheduled_tokens) == {"a1", "base"}
    assert so.lora_loads == ((0, A),)
    assert [nr.lora_slot for nr in so.scheduled_new_reqs] == [0, -1]
    assert s.get_stats().num_waiting_deferred == 1  # b1: set aside, not short of room (metrics' "deferred")
    while "a1" in s.requests:
        so = step(s)
        assert "b1" not in so.num_scheduled_tokens
    so = step(s)  # a1 finished: b1 takes the slot, the workers load B into it
    assert "b1" in so.num_scheduled_tokens and so.lora_loads == ((0, B),)
    while s.has_unfinished_requests():
        step(s)
    assert s.lora_slots.users == [0]


def test_per_step_cap_on_distinct_adapters():
    s = make(max_loras=3, per_step=2)
    for i, h in enumerate((A, B, C, A)):
        add(s, f"r{i}", h)
    seen = []
    while s.has_unfinished_requests():
        so = step(s)
        assert len(adapters_of(s, so)) <= 2
        seen.append(adapters_of(s, so))
    assert any(C.key in x for x in seen)  # the third adapter ran once a place was free


def test_preemption_releases_the_slot():
    s = make(max_loras=1)
    add(s, "a1", A, n_prompt=6)
    so = step(s)
    req = s.requests["a1"]
    assert req.lora_slot == 0 and s.lora_slots.users == [1]
    s.running.remove(req)
    s._preempt(req)
    assert req.lora_slot == -1 and s.lora_slots.users == [0]
    s.finish_requests(["a1"], req.status.FINISHED_ABORTED)
    assert s.lora_slots.users == [0]


def test_block_hashes_key_the_adapter_identity():
    tokens = list(range(8))
    sp = SamplingParams(max_tokens=1)
    kv = KVCacheManager(16, 4, True)
    reqs = [Request("x", tokens, sp, 1), Request("y", tokens, sp, 1, lora=A), Request("z", tokens, sp, 1, lora=B),
            Request("w", tokens, sp, 1, lora=LoRAHandle("a", "a:other-digest", "/adapters/a2"))]
    for r in reqs:
        kv.get_computed_blocks(r)
    first = [r.block_hashes[0] for r in reqs]
    assert len(set(first)) == 4  # base, two adapters, and one name with other weights: all apart
    again = Request("y2", tokens, sp, 1, lora=A)
    kv.get_computed_blocks(again)
    assert again.block_hashes == reqs[1].block_hashes
