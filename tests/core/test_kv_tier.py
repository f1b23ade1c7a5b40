"""The KV offload tier's core side without a model: the tier index (LRU, capacity, pins) and the
scheduler's plans (stores on eviction, loads before admission, failures -> recompute)."""
from collections import OrderedDict

import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.core.contracts import LoRAHandle, ModelRunnerOutput
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_tier import KVTier, LOADING, TierIndex
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams
from scheduler_steps import fake_step

BS = 4


def h(i: int) -> bytes:
    return i.to_bytes(4, "little")


# ---- the index ------------------------------------------------------------------------------------
def test_index_fills_then_evicts_least_recently_used():
    idx = TierIndex(3)
    assert [idx.reserve(h(i)) for i in range(3)] == [(0, None), (1, None), (2, None)]
    idx.touch(h(0))  # order now 1, 2, 0
    assert idx.reserve(h(3)) == (1, h(1))
    assert idx.lru_order() == [h(2), h(0), h(3)]
    assert idx.reserve(h(0)) == (None, None)  # held already: touched, nothing to store
    assert idx.lru_order() == [h(2), h(3), h(0)]
    idx.check_consistency()


def test_pinned_slots_are_never_reused_and_orphans_free_on_unpin():
    idx = TierIndex(2)
    idx.reserve(h(0)), idx.reserve(h(1))
    idx.pin(0)
    idx.pin(1)
    assert idx.reserve(h(2)) == (None, None)  # every slot is being loaded from
    idx.unpin(1)
    assert idx.reserve(h(2)) == (1, h(1))
    assert idx.remove(h(0)) == 0  # a failed load forgets its hash while the slot is still pinned
    idx.check_consistency()
    assert idx.reserve(h(3)) == (1, h(2))  # slot 0 is not free yet: the LRU entry goes
    idx.unpin(0)
    assert idx.reserve(h(4)) == (0, None)
    idx.check_consistency()
    with pytest.raises(RuntimeError):
        idx.unpin(0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.lists(st.tuples(st.sampled_from("rtpuxc"), st.integers(0, 9)), max_size=60))
def test_index_property_no_leak_capacity_lru(num_slots, ops):
    """Against a reference model: capacity respected, no slot leaked or shared, LRU order kept,
    a pinned slot never handed to another hash."""
    idx = TierIndex(num_slots)
    model: OrderedDict[bytes, int] = OrderedDict()
    pins: dict[int, int] = {}
    for op, k in ops:
        key = h(k)
        if op == "r":
            slot, evicted = idx.reserve(key)
            orphans = {p for p in pins if p not in model.values()}
            if key in model:
                assert slot is None and evicted is None
                model.move_to_end(key)
            elif slot is None:  # no free slot and every held one pinned
                assert len(model) + len(orphans) == num_slots and all(v in pins for v in model.values())
            else:
                assert slot not in pins
                if evicted is None:
                    assert slot not in model.values()
                else:
                    assert evicted == next(e for e, v in model.items() if v not in pins)  # the LRU unpinned one
                    assert model.pop(evicted) == slot
                model[key] = slot
        elif op == "t":
            idx.touch(key)
            if key in model:
                model.move_to_end(key)
        elif op == "p" and key in model:
            idx.pin(model[key])
            pins[model[key]] = pins.get(model[key], 0) + 1
        elif op == "u" and pins:
            slot = sorted(pins)[k % len(pins)]
            idx.unpin(slot)
            pins[slot] -= 1
            if not pins[slot]:
                del pins[slot]
        elif op == "x":
            assert idx.remove(key) == model.pop(key, None)
        elif op == "c":
            assert sorted(idx.clear()) == sorted(model.values())
            model.clear()
        idx.check_consistency()
        assert idx.lru_order() == list(model)
        assert len(idx) <= num_slots


# ---- the scheduler with a tier ------------------------------------------------------------------
def make(num_blocks=8, slots=32, budget=64, max_num_seqs=4):
    kv = KVCacheManager(num_blocks, BS, True, tier=KVTier(slots, bytes_per_block=1000))
    return Scheduler(SchedulerLimits(max_num_seqs, budget, 256), kv)


def add(s, rid, tokens, max_tokens=1, salt=None, lora=None):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    s.add_request(Request(rid, list(tokens), sp, max_tokens=max_tokens, cache_salt=salt, lora=lora))


def drain(s, fail=frozenset()):
    """Steps until nothing is left; ``fail``: device blocks whose loads fail (in every step)."""
    steps = []
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        ids = list(so.num_scheduled_tokens)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        failed = frozenset(c.block_id for c in so.kv_transfers.loads if c.block_id in fail or "all" in fail)
        s.update_from_output(so, ModelRunnerOutput(ids, sampled, failed_kv_loads=failed))
        steps.append(so)
        s.kv.pool.check_consistency()
        s.kv.tier.check_consistency()
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == s.kv.num_total_blocks  # no block leaked
    return steps


DOC = list(range(100, 124))  # 24 tokens: 6 full blocks (5 can hit: the last token is computed)
OTHER = list(range(500, 528))


def evict_doc(s):
    add(s, "a", DOC)
    drain(s)
    add(s, "b", OTHER)  # 7 blocks of an 8-block cache: a's cached blocks are handed out again
    steps = drain(s)
    stored = [c for so in steps for c in so.kv_transfers.stores]
    return stored


def doc_hashes(s, salt=None, lora=None):
    r = Request("x", DOC, SamplingParams(max_tokens=1), max_tokens=1, cache_salt=salt, lora=lora)
    s.kv._update_hashes(r)
    return r.block_hashes


def test_evicted_blocks_are_stored_then_loaded_before_admission():
    s = make()
    stored = evict_doc(s)
    hashes = doc_hashes(s)
    assert len({c.block_hash for c in stored} & set(hashes[:5])) >= 4  # b's blocks overwrote a's
    looked_up = s.get_stats().kv_tier.lookup_tokens  # a's and b's tokens: neither was on the device
    assert looked_up == len(DOC) + len(OTHER)
    add(s, "a2", DOC)
    so = s.schedule()
    assert so.num_scheduled_tokens == {}  # nothing computed: its blocks are loading
    loads = so.kv_transfers.loads
    n_dev = 5 - len(loads)  # leading blocks still on the device
    assert len(loads) >= 4 and [c.block_hash for c in loads] == hashes[n_dev:5]
    assert s.kv.tier.load_state("a2") == LOADING
    s.update_from_output(so, ModelRunnerOutput([], []))
    assert s.kv.tier.load_state("a2") is None  # back: the blocks are cached, the request holds none
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a2": 4}  # 5 blocks hit (device + tier), the last 4 tokens computed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20
    s.update_from_output(so, ModelRunnerOutput(["a2"], [[7]]))
    tier = s.get_stats().kv_tier
    assert tier.hit_tokens == len(loads) * BS and tier.loaded_blocks == len(loads) and tier.stored_blocks >= 5
    assert tier.lookup_tokens - looked_up == len(DOC) - n_dev * BS
    drain(s)


@pytest.mark.parametrize("bad", [0, 2])
def test_failed_load_recomputes_from_there_and_forgets_the_slot(bad):
    s = make()
    evict_doc(s)
    add(s, "a2", DOC)
    so = s.schedule()
    loads = so.kv_transfers.loads
    n_dev = 5 - len(loads)
    s.update_from_output(so, ModelRunnerOutput([], [], failed_kv_loads=frozenset({loads[bad].block_id})))
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == (n_dev + bad) * BS  # the chain stops at the failed block
    assert loads[bad].block_hash not in s.kv.tier.index
    assert loads[bad].slot in so.kv_transfers.drops  # the workers forget the slot
    assert s.get_stats().kv_tier.failed_loads == 1
    s.update_from_output(so, ModelRunnerOutput(["a2"], [[7]]))
    drain(s)


def test_abort_while_loading_leaks_nothing():
    s = make()
    evict_doc(s)
    add(s, "a2", DOC)
    so = s.schedule()
    assert so.kv_transfers.loads
    s.finish_requests(["a2"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    assert s.kv.tier.index._pins  # the step still reads those slots
    s.update_from_output(so, ModelRunnerOutput([], []))
    assert not s.kv.tier.index._pins
    s.kv.tier.check_consistency()
    assert not s.has_unfinished_requests()


def test_a_failed_step_fails_its_loads():
    s = make()
    evict_doc(s)
    add(s, "a2", DOC)
    so = s.schedule()
    n_dev = 5 - len(so.kv_transfers.loads)
    s.rewind(so)  # the step raised (engine/core.py isolates): its loads cannot be trusted
    so = s.schedule()
    assert not so.kv_transfers.loads and so.scheduled_new_reqs[0].num_computed_tokens == n_dev * BS
    s.update_from_output(so, ModelRunnerOutput(["a2"], [[7]]))
    drain(s)


def test_tier_is_keyed_by_cache_salt_and_adapter():
    s = make()
    add(s, "a", DOC, salt="tenant-1")
    drain(s)
    add(s, "b", OTHER)
    drain(s)
    assert len(s.kv.tier.lookup(doc_hashes(s, salt="tenant-1")[1:])) >= 4
    lora = LoRAHandle("ad", "ad-key", "/nowhere")
    for salt, handle in (("tenant-2", None), (None, None), ("tenant-1", lora), (None, lora)):
        assert s.kv.tier.lookup(doc_hashes(s, salt=salt, lora=handle)) == []
    for rid, salt in (("other-tenant", "tenant-2"), ("no-salt", None)):
        add(s, rid, DOC, salt=salt)
        so = s.schedule()
        assert not so.kv_transfers.loads and so.num_scheduled_tokens[rid] == len(DOC)
        s.update_from_output(so, ModelRunnerOutput([rid], [[7]]))
    add(s, "same-tenant", DOC, salt="tenant-1")
    so = s.schedule()
    assert so.kv_transfers.loads  # only the same key finds the tenant's blocks


def test_preempted_request_comes_back_from_the_tier():
    """Swap preemption: the victim's full blocks (prompt and outputs) go to the tier when their
    device blocks are reused, and it resumes from them instead of recomputing."""
    s = make(num_blocks=10, slots=64, budget=64, max_num_seqs=2)
    add(s, "long", list(range(1000, 1020)), max_tokens=20)  # 5 blocks, grows to 10
    add(s, "late", list(range(2000, 2016)), max_tokens=20)
    resumed_at = None
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        for nr in so.scheduled_new_reqs:
            if s.requests[nr.req_id].num_preemptions and resumed_at is None:
                resumed_at = nr.num_computed_tokens
        ids = list(so.num_scheduled_tokens)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        s.update_from_output(so, ModelRunnerOutput(ids, sampled))
        s.kv.pool.check_consistency()
        s.kv.tier.check_consistency()
    assert s.num_preemptions >= 1
    assert resumed_at is not None and resumed_at >= 4 * BS  # not recomputed from 0
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_reset_prefix_cache_empties_the_tier():
    s = make()
    evict_doc(s)
    held = len(s.kv.tier.index)
    assert held and s.kv.reset_prefix_cache()
    assert len(s.kv.tier.index) == 0
    so = s.schedule()
    assert len(so.kv_transfers.drops) == held


def test_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVCacheManager(8, BS, False, tier=KVTier(4))
