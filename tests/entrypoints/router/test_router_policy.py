"""The router's pure parts: the LRU prefix index and the replica choice (no sockets, no model)."""
import pytest

from pagedllm.core.block_hash import extend_block_hashes
from pagedllm.entrypoints.router.prefix_index import PrefixIndex
from pagedllm.entrypoints.router.prompt_hashes import PromptHasher
from pagedllm.entrypoints.router.replicas import ReplicaSet


def chain(tokens, block_size=4, key=None):
    out = []
    extend_block_hashes(out, tokens, block_size, key)
    return out


def test_index_matches_leading_run_and_evicts_tails_first():
    idx = PrefixIndex(capacity_blocks=4)
    a = chain(list(range(16)))  # 4 blocks
    idx.insert(a)
    assert idx.match(a) == 4
    assert idx.match(chain(list(range(8)) + [99] * 8)) == 2  # diverges in block 2
    b = chain([7] * 8)
    idx.insert(b)  # 2 new blocks push out a's two tail blocks, never its head
    assert len(idx) == 4
    assert idx.match(a) == 2 and idx.match(b) == 2
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_prefix_choice_least_loaded_fallback_and_imbalance_guard():
    rs = ReplicaSet(["http://a", "http://b", "http://c"], max_load_imbalance=2)
    for r in rs.replicas:
        rs.mark_up(r)
    p1, p2 = chain([1] * 32), chain([2] * 32)
    first = rs.choose(p1)
    assert first.matched_blocks == 0  # nothing cached anywhere: least loaded
    again = rs.choose(p1)
    assert again.replica is first.replica and again.matched_blocks == 8
    other = rs.choose(p2)  # a new prefix goes to a less loaded replica
    assert other.replica is not first.replica and other.matched_blocks == 0
    # a longer shared prefix wins over a shorter one
    longer = chain([1] * 16 + [5] * 16)
    assert rs.choose(longer).replica is first.replica
    # the owner now has 3 in flight, the least loaded 0: past the imbalance of 2, load wins
    spill = rs.choose(p1)
    assert spill.replica is not first.replica and spill.matched_blocks == 0
    for r in rs.replicas:
        while r.in_flight:
            rs.finish(r)
    assert rs.choose(p1).matched_blocks == 8


def test_a_short_shared_preamble_does_not_decide():
    rs = ReplicaSet(["http://a", "http://b"], min_prefix_ratio=0.5)
    for r in rs.replicas:
        rs.mark_up(r)
    first = rs.choose(chain([9] * 4 + [1] * 28))  # 8 blocks
    rs.finish(first.replica)
    # shares 1 of 8 blocks (a chat template's boilerplate): load decides, not the owner
    second = rs.choose(chain([9] * 4 + [2] * 28))
    assert second.matched_blocks == 0 and second.replica is not first.replica
    rs.finish(second.replica)
    # shares 4 of 8: enough
    third = rs.choose(chain([9] * 4 + [1] * 12 + [3] * 16))
    assert third.replica is first.replica and third.matched_blocks == 4


def test_round_robin_and_least_loaded_ignore_prefixes():
    rr = ReplicaSet(["http://a", "http://b"], policy="round_robin")
    ll = ReplicaSet(["http://a", "http://b"], policy="least_loaded")
    for rs in (rr, ll):
        for r in rs.replicas:
            rs.mark_up(r)
    p = chain([3] * 16)
    assert [rr.choose(p).replica.id for _ in range(4)] == [0, 1, 0, 1]
    c1, c2 = ll.choose(p), ll.choose(p)
    assert c1.replica is not c2.replica and c1.matched_blocks == c2.matched_blocks == 0


def test_mark_down_backs_off_and_forgets_the_index():
    rs = ReplicaSet(["http://a", "http://b"], retry_min_s=1.0, retry_max_s=5.0)
    a, b = rs.replicas
    rs.mark_up(a)
    rs.mark_up(b)
    p = chain([4] * 16)
    owner = rs.choose(p).replica
    rs.finish(owner)
    rs.mark_down(owner, "connect error", now=100.0)
    assert not owner.healthy and len(owner.prefix) == 0
    assert owner.next_check == 101.0
    rs.mark_down(owner, "again", now=101.0)
    rs.mark_down(owner, "again", now=103.0)
    rs.mark_down(owner, "again", now=107.0)
    assert owner.next_check == 107.0 + 5.0  # 1, 2, 4, then capped at 5
    assert owner not in rs.due_for_check(2.0, now=111.0) and owner in rs.due_for_check(2.0, now=112.0)
    other = rs.replicas[1 - owner.id]
    assert other in rs.due_for_check(2.0, now=200.0)  # healthy: every interval
    assert other not in rs.due_for_check(2.0, now=201.0) and other in rs.due_for_check(2.0, now=202.0)
    assert rs.choose(p).replica is not owner  # only the healthy one takes requests
    rs.mark_down(rs.replicas[1 - owner.id], "gone", now=0.0)
    assert rs.choose(p) is None


def test_never_up_replica_is_polled_at_the_shortest_interval():
    rs = ReplicaSet(["http://a"], retry_min_s=0.5, retry_max_s=30.0)
    r = rs.replicas[0]
    for t in range(5):
        rs.mark_down(r, "loading", now=float(t))
    assert r.next_check == 4.5


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        ReplicaSet([])
    with pytest.raises(ValueError, match="routing policy"):
        ReplicaSet(["http://a"], policy="random")
    with pytest.raises(ValueError, match="http://"):
        ReplicaSet(["localhost:8000"])


class CharTokenizer:
    def encode(self, text):
        return [ord(c) % 512 for c in text]


def test_prompt_hashes_follow_the_engine_chain_and_keys():
    h = PromptHasher(CharTokenizer(), 4, {"base"})
    text = "abcdefghij"  # 10 tokens: 2 full blocks
    want = chain(CharTokenizer().encode(text), 4)
    assert h.block_hashes("/v1/completions", {"model": "base", "prompt": text}) == want
    assert h.block_hashes("/v1/completions", {"prompt": [text, "zzzz"]}) == want  # a batch: its first prompt
    assert h.block_hashes("/v1/completions", {"prompt": [97, 98, 99, 100]}) == chain([97, 98, 99, 100], 4)
    adapter = h.block_hashes("/v1/completions", {"model": "my-lora", "prompt": text})
    assert len(adapter) == 2 and adapter[0] != want[0]  # another model never shares the base's entries
    assert h.block_hashes("/v1/completions", {"prompt": {"bad": 1}}) == []
    assert h.block_hashes("/v1/chat/completions", {"messages": "nope"}) == []
    bare = PromptHasher(None, 4, {"base"})  # replicas without a tokenizer: token ids only
    assert bare.block_hashes("/v1/completions", {"prompt": text}) == []
    assert bare.block_hashes("/v1/completions", {"prompt": [97, 98, 99, 100]}) == chain([97, 98, 99, 100], 4)
    assert bare.block_hashes("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) == []
