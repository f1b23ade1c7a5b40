"""DiskTierStore, the ``disk`` KV offload tier behind the store Protocol: cache tensors' blocks (K/V
planes and an 8-bit cache's scales) round-trip through files, a slot given a new hash never
returns the old one, layouts and shards keep their own directories, and run directories of dead
processes are swept."""
import os
import socket
from types import SimpleNamespace

import pytest
import torch

from pagedllm.worker.kv_tier.disk import DiskTierStore
from pagedllm.worker.kv_tier.store import BLOCK_DIM, TierBlockLayout

NUM_BLOCKS = 8


def config(tmp_path, **kw):
    base = dict(model=str(tmp_path), dtype="float32", kv_cache_dtype="auto", quantization=None,
                tensor_parallel_size=1, kv_offload_dir=str(tmp_path / "tier"))
    base.update(kw)
    return SimpleNamespace(**base)


def caches(quant: bool):
    g = torch.Generator().manual_seed(0)
    if not quant:
        return [torch.randn((2, 2, NUM_BLOCKS, 16, 2, 8), generator=g)]
    values = torch.randint(-128, 127, (2, 2, NUM_BLOCKS, 16, 2, 8), generator=g, dtype=torch.int8)
    scales = torch.rand((2, 2, NUM_BLOCKS, 16, 2), generator=g).to(torch.bfloat16)
    return [values, scales]


def blocks(cs, ids):
    return [c.index_select(BLOCK_DIM, torch.tensor(ids)) for c in cs]


@pytest.mark.parametrize("quant", [False, True], ids=["float32", "int8+scales"])
def test_blocks_round_trip_through_files(tmp_path, quant):
    cs = caches(quant)
    layout = TierBlockLayout.of(cs)
    store = DiskTierStore(config(tmp_path), layout, num_slots=4, rank=0)
    store.put([2, 0], [b"h2", b"h0"], blocks(cs, [5, 1]))
    store.files.flush(10)
    out = layout.empty_batch(3)
    assert store.get([0, 2, 1], [b"h0", b"h2", b"h1"], out) == [True, True, False]  # slot 1: never stored
    for o, want in zip(out, blocks(cs, [1, 5])):
        assert torch.equal(o[:, :, :2], want)
    assert store.stats.writes_done == 2
    store.close()
    assert not os.path.exists(store.files.root)


def test_a_slot_given_a_new_hash_never_returns_the_old(tmp_path):
    cs = caches(False)
    layout = TierBlockLayout.of(cs)
    store = DiskTierStore(config(tmp_path), layout, num_slots=2, rank=0)
    store.put([0], [b"old"], blocks(cs, [0]))
    store.files.flush(10)
    old_file = store.files.path_of(b"old")
    store.put([0], [b"new"], blocks(cs, [3]))
    out = layout.empty_batch(1)
    assert store.get([0], [b"old"], out) == [False]
    assert store.get([0], [b"new"], out) == [True] and torch.equal(out[0], blocks(cs, [3])[0])
    store.files.flush(10)
    assert not os.path.exists(old_file)
    store.discard([0])
    assert store.get([0], [b"new"], out) == [False] and len(store.files) == 0
    store.close()


def test_layouts_and_shards_keep_their_own_directories(tmp_path):
    cs = caches(False)
    layout = TierBlockLayout.of(cs)
    a = DiskTierStore(config(tmp_path, tensor_parallel_size=2), layout, 2, rank=0)
    b = DiskTierStore(config(tmp_path, tensor_parallel_size=2), layout, 2, rank=1)
    c = DiskTierStore(config(tmp_path, kv_cache_dtype="int8"), layout, 2, rank=0)
    bases = {os.path.dirname(s.files.root) for s in (a, b, c)}
    assert len(bases) == 3
    assert all(os.path.isfile(os.path.join(p, "layout.txt")) for p in bases)
    for s in (a, b, c):
        s.close()


def test_run_directories_of_dead_processes_are_swept(tmp_path):
    cs = caches(False)
    layout = TierBlockLayout.of(cs)
    a = DiskTierStore(config(tmp_path), layout, 2, rank=0)
    base = os.path.dirname(a.files.root)
    dead = os.path.join(base, f"run-{socket.gethostname()}-{2**22 + 12345}-0")  # above any pid_max: not alive
    other_host = os.path.join(base, "run-some-other-host-1-0")
    alive = os.path.join(base, f"run-{socket.gethostname()}-1-0")  # pid 1 is always alive
    for d in (dead, other_host, alive):
        os.makedirs(os.path.join(d, "ab"))
    b = DiskTierStore(config(tmp_path), layout, 2, rank=0)
    assert not os.path.exists(dead) and os.path.exists(other_host) and os.path.exists(alive)
    assert os.path.exists(a.files.root) and b.files.root != a.files.root  # this process's runs stay apart
    a.close()
    b.close()


def test_needs_a_directory(tmp_path):
    layout = TierBlockLayout.of(caches(False))
    with pytest.raises(ValueError, match="kv_offload_dir"):
        DiskTierStore(config(tmp_path, kv_offload_dir=None), layout, 2, rank=0)



def test_host_part_spills_its_least_recently_used_blocks_to_disk(tmp_path):
    from pagedllm.worker.kv_tier.host import HostTierStore
    from pagedllm.worker.kv_tier.spill import SpillingTierStore

    cs = caches(True)
    layout = TierBlockLayout.of(cs)
    store = SpillingTierStore(HostTierStore(layout, 2), DiskTierStore(config(tmp_path), layout, 6, rank=0))
    store.put([0, 1], [b"a", b"b"], blocks(cs, [0, 1]))
    assert len(store.disk.files) == 0  # all in host memory
    out = layout.empty_batch(1)
    assert store.get([0], [b"a"], out) == [True]  # "a" is now the most recently used
    store.put([2], [b"c"], blocks(cs, [2]))  # spills "b"
    assert store.spilled_blocks == 1 and b"b" in store.disk.files
    store.put([3, 4, 5], [b"d", b"e", b"f"], blocks(cs, [3, 4, 5]))  # larger than the host part: "d" goes direct
    assert b"d" in store.disk.files
    out = layout.empty_batch(6)
    ok = store.get([5, 1, 0, 3, 4, 2], [b"f", b"b", b"a", b"d", b"e", b"c"], out)
    assert ok == [True] * 6
    for o, want in zip(out, blocks(cs, [5, 1, 0, 3, 4, 2])):
        assert torch.equal(o, want)
    store.discard([1, 5])
    assert store.get([1, 5], [b"b", b"f"], layout.empty_batch(2)) == [False, False]
    store.close()
