"""The host KV offload tier store and the runner's copies (no model): round trips, hash checks,
stores before loads within one step, failures degrading to "load failed"."""
import torch

from pagedllm.core.contracts import KVTransfers, TierCopy
from pagedllm.worker.kv_tier.host import HostTierStore
from pagedllm.worker.kv_tier.store import TierBlockLayout
from pagedllm.worker.kv_tier.transfer import TierTransfers


def caches(num_blocks=6, quant=False):
    torch.manual_seed(0)
    kv = torch.randn(2, 3, num_blocks, 4, 2, 5)  # [planes, layers, blocks, block_size, kv_heads, head_dim]
    if not quant:
        return [kv]
    return [kv.to(torch.int8), torch.randn(2, 3, num_blocks, 4, 2).to(torch.bfloat16)]


def test_layout_and_host_round_trip_checks_hashes():
    cs = caches(quant=True)
    layout = TierBlockLayout.of(cs)
    assert layout.batch_shape(0, 7) == (2, 3, 7, 4, 2, 5) and layout.batch_shape(1, 7) == (2, 3, 7, 4, 2)
    assert layout.bytes_per_block == 2 * 3 * 4 * 2 * (5 * 1 + 2)
    store = HostTierStore(layout, 4)
    blocks = [c.index_select(2, torch.tensor([1, 3])) for c in cs]
    store.put([2, 0], [b"h1", b"h3"], blocks)
    out = layout.empty_batch(3)
    assert store.get([0, 2, 1], [b"h3", b"h1", b"h1"], out) == [True, True, False]  # slot 1 holds nothing
    assert torch.equal(out[0][:, :, 0], cs[0][:, :, 3]) and torch.equal(out[1][:, :, 1], cs[1][:, :, 1])
    assert store.get([0], [b"other"], layout.empty_batch(1)) == [False]  # a stale slot never loads
    store.discard([0])
    assert store.get([0], [b"h3"], layout.empty_batch(1)) == [False]


def test_transfers_store_before_load_in_one_step():
    """A block evicted and reused in the same step is saved before anything overwrites it, and a
    load of that very hash in the same step reads the saved copy."""
    cs = caches()
    before = cs[0].clone()
    t = TierTransfers(HostTierStore(TierBlockLayout.of(cs), 8), cs)
    step = KVTransfers(stores=(TierCopy(1, 5, b"a"), TierCopy(2, 6, b"b")),
                       loads=(TierCopy(1, 6, b"b"), TierCopy(4, 5, b"a")), seq=1)
    failed, seconds = t.run(step)
    assert failed == frozenset() and seconds >= 0
    assert torch.equal(cs[0][:, :, 1], before[:, :, 2]) and torch.equal(cs[0][:, :, 4], before[:, :, 1])
    assert torch.equal(cs[0][:, :, 0], before[:, :, 0])  # untouched blocks stay as they were


def test_failed_loads_are_reported_and_leave_nothing_wrong():
    cs = caches()
    before = cs[0].clone()
    store = HostTierStore(TierBlockLayout.of(cs), 8)
    t = TierTransfers(store, cs)
    t.run(KVTransfers(stores=(TierCopy(0, 0, b"x"),), seq=1))
    failed, _ = t.run(KVTransfers(loads=(TierCopy(3, 0, b"x"), TierCopy(5, 1, b"never-stored")), seq=2))
    assert failed == frozenset({5})
    assert torch.equal(cs[0][:, :, 3], before[:, :, 0]) and torch.equal(cs[0][:, :, 5], before[:, :, 5])


class Broken:
    """A store whose disk is gone: every call raises."""

    num_slots = 4
    discarded = []

    def put(self, slots, hashes, blocks):
        raise OSError("no space left on device")

    def get(self, slots, hashes, out):
        raise OSError("input/output error")

    def discard(self, slots):
        self.discarded.extend(slots)

    def close(self):
        pass


def test_a_raising_store_degrades_to_recompute():
    cs = caches()
    t = TierTransfers(Broken(), cs)
    failed, _ = t.run(KVTransfers(stores=(TierCopy(0, 2, b"x"),), loads=(TierCopy(1, 3, b"y"),), seq=1))
    assert failed == frozenset({1}) and Broken.discarded == [2]


def test_an_unused_host_tier_costs_no_resident_memory():
    """The pool's pages are faulted in when first written: a 512 MiB tier is not 512 MiB of RSS
    (nor a half-second memset) at start-up."""
    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) / 1024

    layout = TierBlockLayout(((2, 4, 16, 8, 64),), (torch.bfloat16,))  # 128 KiB a block
    before = rss_mib()
    store = HostTierStore(layout, 4096)  # 512 MiB
    assert store.nbytes == 512 << 20
    assert rss_mib() - before < 64
    out = layout.empty_batch(1)
    assert store.get([5], [b"h"], out) == [False]
    cs = [torch.ones(2, 4, 1, 16, 8, 64, dtype=torch.bfloat16)]
    store.put([5], [b"h"], cs)
    assert store.get([5], [b"h"], out) == [True] and torch.equal(out[0], cs[0])
    assert not store.pools[0][:, :, 4].any()  # the rest reads as zeros
