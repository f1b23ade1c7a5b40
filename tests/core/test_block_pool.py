"""Block pool / KV cache manager: ref counts, LRU free queue, prefix-cache hits, no leaks."""
from hypothesis import given, settings, strategies as st

from pagedllm.core.block_hash import extend_block_hashes, hash_block_tokens
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def make_req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=8), max_tokens=8)


def test_hash_is_stable_and_chained():
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(None, [1, 2, 3])
    assert a != hash_block_tokens(None, [1, 2, 4])
    assert hash_block_tokens(a, [5]) != hash_block_tokens(None, [5])
    assert hash_block_tokens(None, [1], "salt") != hash_block_tokens(None, [1])
    hs = []
    extend_block_hashes(hs, list(range(10)), 4)
    assert len(hs) == 2 and hs[1] == hash_block_tokens(hs[0], [4, 5, 6, 7])


def test_free_queue_order_and_lazy_eviction():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 32)
    pool.free_blocks(reversed(blocks))  # tail first
    assert [b.block_id for b in pool.free_queue] == [3, 2, 1, 0]
    assert pool.get_cached_block(bytes([0]) * 32) is blocks[0]  # still cached while free
    pool.get_new_blocks(2)  # takes 3 (never hashed) then 2 (evicts its hash)
    assert pool.get_cached_block(bytes([2]) * 32) is None
    assert pool.get_cached_block(bytes([1]) * 32) is blocks[1]
    pool.check_consistency()


def test_prefix_hit_shares_blocks_and_caps_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_req("a", list(range(12)))
    hit, n = kv.get_computed_blocks(a)
    assert (hit, n) == ([], 0)
    kv.allocate_slots(a, 12)
    b = make_req("b", list(range(12)))
    hit, n = kv.get_computed_blocks(b)
    assert n == 8  # 12 tokens, 3 full blocks, but the last token must be computed
    ids = kv.allocate_slots(b, 4, n, hit)
    assert ids[:2] == kv.get_block_ids("a")[:2]
    assert kv.pool.blocks[ids[0]].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16
    kv.pool.check_consistency()


def test_allocate_returns_none_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_req("a", list(range(8)))
    assert kv.allocate_slots(a, 8) is not None
    b = make_req("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1
    kv.pool.check_consistency()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "fail"]), st.integers(0, 5), st.integers(1, 40)),
                max_size=60),
       st.sampled_from([1, 4, 16]))
def test_random_add_grow_free_keeps_pool_consistent(ops, block_size):
    kv = KVCacheManager(num_blocks=24, block_size=block_size)
    live: dict[str, Request] = {}
    prefixes = [list(range(p * 7, p * 7 + 40)) for p in range(3)]
    n = 0
    for op, k, length in ops:
        if op == "add":
            rid = f"r{n}"
            n += 1
            req = make_req(rid, prefixes[k % 3][:length])
            hit, num_hit = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is not None:
                req.num_computed_tokens = req.num_tokens
                live[rid] = req
        elif op == "grow" and live:
            req = live[sorted(live)[k % len(live)]]
            req.append_output_token(1000 + k)
            if kv.allocate_slots(req, 1) is not None:
                req.num_computed_tokens += 1
            else:
                kv.free(req)
                del live[req.request_id]
        elif op == "free" and live:
            rid = sorted(live)[k % len(live)]
            kv.free(live.pop(rid))
        elif op == "fail" and live:  # a failed step: blocks no one else holds leave the cache
            req = live.pop(sorted(live)[k % len(live)])
            blocks = list(kv.req_blocks[req.request_id])
            kv.free(req, uncache=True)
            assert all(b.block_hash is None for b in blocks if b.ref_cnt == 0)
        kv.pool.check_consistency()
        held = sum(len(kv.req_blocks[r]) for r in live)
        assert kv.num_free_blocks >= kv.num_total_blocks - held
    for req in list(live.values()):
        kv.free(req)
    kv.pool.check_consistency()
    assert kv.num_free_blocks == kv.num_total_blocks


def test_cache_salt_keeps_tenants_apart():
    """vLLM's cache_salt: the salt keys the first block and the chain carries it, so requests with
    different salts (or one salted and one not) never share a block; the same salt shares."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    tokens = list(range(12))
    a = Request("a", tokens, SamplingParams(max_tokens=8), max_tokens=8, cache_salt="tenant-1")
    kv.get_computed_blocks(a)
    kv.allocate_slots(a, 12)
    for rid, salt, hit in (("b", "tenant-2", 0), ("c", None, 0), ("d", "tenant-1", 8)):
        r = Request(rid, tokens, SamplingParams(max_tokens=8), max_tokens=8, cache_salt=salt)
        blocks, n = kv.get_computed_blocks(r)
        assert n == hit, (rid, salt)
        if salt != "tenant-1":
            assert not set(r.block_hashes) & set(a.block_hashes)  # every block of the chain differs
    kv.free(a)
    assert kv.num_free_blocks == 32
    kv.pool.check_consistency()


def test_block_states_follow_holders_and_the_prefix_cache():
    from pagedllm.core.block_pool import BLOCK_CACHED, BLOCK_FREE, BLOCK_IN_USE, BLOCK_SHARED

    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.block_states() == bytes([BLOCK_FREE] * 8)
    a = make_req("a", list(range(12)))
    kv.get_computed_blocks(a)
    kv.allocate_slots(a, 12)
    b = make_req("b", list(range(12)))
    hit, n = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 4, n, hit)
    states = kv.block_states()
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert [states[i] for i in a_ids[:2]] == [BLOCK_SHARED] * 2  # the hit blocks: two holders
    assert states[a_ids[2]] == BLOCK_IN_USE and states[b_ids[2]] == BLOCK_IN_USE
    assert states.count(BLOCK_FREE) == 8 - 4
    kv.free(a)
    kv.free(b)
    states = kv.block_states()
    assert states.count(BLOCK_IN_USE) == states.count(BLOCK_SHARED) == 0
    assert states.count(BLOCK_CACHED) == 3  # a's three full blocks stay in the prefix cache, evictable


def test_a_block_filled_by_a_token_in_flight_is_registered_once_that_token_is_known():
    """Async scheduling schedules a request past its token in flight: the block that token
    completes cannot be hashed yet (and the decode fast path takes it), but the next step, with
    the token known, registers it, so a later request hits it."""
    kv = KVCacheManager(16, 4, True)
    r = make_req("a", [1, 2, 3])
    kv.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    r.num_pending = 1  # its 4th token is being sampled by the step in flight
    assert kv.allocate_slots(r, 1) == []  # position 3 is in block 0; its token is unknown
    assert not kv.pool.cached
    r.num_computed_tokens = 4
    r.append_output_token(7)
    r.num_pending = 0
    assert len(kv.allocate_slots(r, 1)) == 1  # a fresh block for position 4, and block 0 registered
    hits, n = kv.get_computed_blocks(make_req("b", [1, 2, 3, 7, 9]))
    assert n == 4 and [b.block_id for b in hits] == kv.get_block_ids("a")[:1]
