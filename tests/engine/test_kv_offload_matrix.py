"""The KV offload tier's correctness matrix: greedy outputs with the tier on equal the outputs
without it, on a device KV cache so small that blocks really leave it and come back from the tier,
for every feature that touches blocks -- prefix caching (host and disk tiers), preemption, a
sliding window, an 8-bit KV cache, multi-head latent attention, LoRA (adapters never share tier
blocks) and beam search -- and the disk tier's failures (corrupt, truncated, stale files, a full
disk) end in the same output, one warning per cause and no leaked block. One engine per
configuration (module-scoped), tiny models."""
from __future__ import annotations

import errno
import logging
import os

import pytest

from prompts import random_prompts
from pagedllm import LLM, SamplingParams

BLOCK = 16
DEVICE_BLOCKS = 12  # 192 tokens: two 80-token prompts evict the first one's blocks
PROMPT_LEN, EXTRA_LEN = 80, 20
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TIER_GIB = 4 / 1024  # 4 MiB: hundreds of the tiny models' blocks
HOST_PART_GIB = 4 * 8192 / 2**30  # native+disk: 4 of the tiny llama's 8 KiB blocks in host memory, the rest spill
DISK_LOGGER = "pagedllm.worker.kv_tier.block_files"


def engine(path, tier=None, tmp=None, **kw):
    """``tier``: None (off), "native" (host memory), "disk" (files under ``tmp``) or "native+disk"."""
    kw = dict(model=path, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=DEVICE_BLOCKS,
              max_model_len=DEVICE_BLOCKS * BLOCK, **kw)
    if tier is not None:
        kw.update(kv_offloading_size=TIER_GIB, kv_offloading_backend=tier)
        if tier in ("disk", "native+disk"):
            kw["kv_offload_dir"] = str(tmp)
        if tier == "native+disk":
            kw["kv_offload_host_size"] = HOST_PART_GIB
    return LLM(**kw)


def check_clean(llm) -> None:
    """No device block held, the pool and the tier's index consistent."""
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "device blocks leaked"
    mgr = llm.engine.core.kv_cache_manager
    mgr.pool.check_consistency()
    if mgr.tier is not None:
        mgr.tier.check_consistency()


def tier_stats(llm):
    return llm.get_stats().kv_tier


def one_by_one(llm, prompts, sp=GREEDY, **kw):
    return [llm.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False, **kw)[0].outputs[0].token_ids
            for p in prompts]


def conversations(seed: int, n: int = 3, first_len: int = PROMPT_LEN, extra_len: int = EXTRA_LEN):
    """Turn 1 of ``n`` conversations, then turn 2 of each (its turn 1 + more tokens): the later
    turns 1 evict the first one's blocks from the 12-block cache, so its turn 2 finds its prefix
    in the tier only."""
    first = random_prompts([first_len] * n, seed=seed)
    more = random_prompts([extra_len] * n, seed=seed + 1000)
    return first + [a + b for a, b in zip(first, more)]


# ---- the models, each with its tier-off reference engine ----------------------------------------
DEEPSEEK = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                topk_group=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


@pytest.fixture(scope="module")
def ckpts(llama_ckpt, make_ckpt):
    """The session's tiny checkpoints (the same names and shapes as the sliding-window and
    kv_cache_dtype tests use, so the suite builds each once)."""
    return {"llama": llama_ckpt,
            "mistral_sw": make_ckpt("mistral_sw24", "mistral", sliding_window=24),
            "deepseek": make_ckpt("kvq_deepseek", "deepseek_v3", layers=2, kv_heads=4, extra=DEEPSEEK)}


@pytest.fixture(scope="module")
def llama_off(ckpts):
    return engine(ckpts["llama"])


@pytest.fixture(scope="module")
def llama_host(ckpts):
    return engine(ckpts["llama"], "native")


@pytest.fixture(scope="module")
def llama_disk(ckpts, tmp_path_factory):
    return engine(ckpts["llama"], "disk", tmp_path_factory.mktemp("kv_disk"))


def assert_same_with_tier(on, off, prompts, **kw):
    before = tier_stats(on).loaded_blocks
    got, want = one_by_one(on, prompts, **kw), one_by_one(off, prompts, **kw)
    assert got == want
    assert tier_stats(on).loaded_blocks > before, "nothing came back from the tier: the test proves nothing"
    check_clean(on)
    return got


@pytest.mark.parametrize("tier", ["native", "disk", "native+disk"])
def test_prefix_hits_from_the_tier_match_recompute(request, ckpts, llama_off, tier, tmp_path):
    on = (request.getfixturevalue("llama_host") if tier == "native" else request.getfixturevalue("llama_disk")
          if tier == "disk" else engine(ckpts["llama"], tier, tmp_path))
    assert_same_with_tier(on, llama_off, conversations(seed=1))
    assert tier_stats(on).failed_loads == 0
    if tier == "native+disk":  # blocks came back from both parts
        store = on.engine.core.executor.worker.kv_tier.store
        assert store.spilled_blocks > 0 and store.disk.stats.loads > 0
        on.shutdown()  # closes the tier: the engine's run directory goes with it
        assert not os.path.exists(store.disk.files.root)


def test_native_disk_flags_are_checked(llama_ckpt, tmp_path):
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match="needs kv_offload_host_size"):
        EngineConfig(model=llama_ckpt, kv_offloading_size=1, kv_offloading_backend="native+disk",
                     kv_offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs kv_offload_dir"):
        EngineConfig(model=llama_ckpt, kv_offloading_size=1, kv_offloading_backend="native+disk",
                     kv_offload_host_size=0.5)
    with pytest.raises(ValueError, match="kv_offload_host_size is the host part"):
        EngineConfig(model=llama_ckpt, kv_offloading_size=1, kv_offload_host_size=0.5)
    # a directory alone (or with the host-memory backend) would leave the tier off or on the host: refused
    for kw in ({}, {"kv_offloading_size": 1}, {"kv_offloading_backend": "disk"}):
        with pytest.raises(ValueError, match="kv_offload_dir is the disk tier's directory"):
            EngineConfig(model=llama_ckpt, kv_offload_dir=str(tmp_path), **kw)
    with pytest.raises(ValueError, match="kv_offload_host_size is the host part"):
        EngineConfig(model=llama_ckpt, kv_offload_host_size=0.5)


def test_preemption_with_the_tier(llama_host, llama_off):
    """Four requests at once that cannot all fit: preempted requests resume from the tier."""
    prompts = random_prompts([60, 61, 62, 63], seed=2)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # 4 x 6 blocks > 12
    before = llama_host.get_stats().num_preemptions
    got = [o.outputs[0].token_ids for o in llama_host.generate(prompt_token_ids=prompts, sampling_params=sp,
                                                               use_tqdm=False)]
    assert llama_host.get_stats().num_preemptions > before
    assert got == one_by_one(llama_off, prompts, sp)
    check_clean(llama_host)


def test_beam_search_with_the_tier(llama_host, llama_off):
    """Beam groups evict into the tier and stay exact. (They do not load from it yet: a beam
    group's admission recomputes its prompt; only plain requests take the tier's loads.)"""
    from pagedllm.engine.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=6)
    prompts = conversations(seed=3, n=4, first_len=48, extra_len=16)  # 2 beams x 70 tokens fit 12 blocks
    before_stored = tier_stats(llama_host).stored_blocks
    got = [llama_host.beam_search([{"prompt_token_ids": p}], params)[0] for p in prompts]
    want = [llama_off.beam_search([{"prompt_token_ids": p}], params)[0] for p in prompts]
    assert [[s.tokens for s in g.sequences] for g in got] == [[s.tokens for s in w.sequences] for w in want]
    assert tier_stats(llama_host).stored_blocks > before_stored  # the beams' blocks went to the tier
    check_clean(llama_host)


@pytest.mark.parametrize("model,kw", [("mistral_sw", {}), ("llama", {"kv_cache_dtype": "int8"}),
                                      ("deepseek", {})], ids=["sliding_window", "int8_kv", "mla"])
def test_block_layouts_with_the_tier(ckpts, model, kw):
    on, off = engine(ckpts[model], "native", **kw), engine(ckpts[model], **kw)
    assert_same_with_tier(on, off, conversations(seed=4))


def test_lora_adapters_never_share_tier_blocks(llama_ckpt, tmp_path_factory):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lora"))
    from peft_adapters import make_adapter
    from pagedllm.lora.request import LoRARequest

    d = tmp_path_factory.mktemp("kv_offload_lora")
    base = llama_ckpt
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(base, str(d / f"a{i}"), r=4, alpha=8, seed=i + 1))
             for i in range(2)]
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    on, off = engine(base, "native", **kw), engine(base, **kw)
    first, second = conversations(seed=5, n=2)[:2], conversations(seed=5, n=2)[2:]
    # turn 1 under both adapters (same tokens), then turn 2 under both: a hit on the other adapter's
    # blocks would change the output
    order = [(p, lora) for p in first for lora in loras] + [(p, lora) for p in second for lora in loras]
    got = [on.generate(prompt_token_ids=[p], sampling_params=GREEDY, lora_request=lora, use_tqdm=False)[0]
           .outputs[0].token_ids for p, lora in order]
    want = [off.generate(prompt_token_ids=[p], sampling_params=GREEDY, lora_request=lora, use_tqdm=False)[0]
            .outputs[0].token_ids for p, lora in order]
    assert got == want and got[0] != got[1], "the adapters must change the output"
    assert tier_stats(on).loaded_blocks > 0
    check_clean(on)


# ---- the disk tier's failures: recompute, one warning, nothing leaked ----------------------------
def disk_store(llm):
    return llm.engine.core.executor.worker.kv_tier.store


def block_files(llm):
    store = disk_store(llm)
    store.files.flush(30)
    root = store.files.root
    return [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".kvb")]


def damage(path: str, how: str) -> None:
    if how == "corrupt":
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x5A]))
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "stale":  # an older format version
        with open(path, "r+b") as f:
            f.seek(8)
            f.write((0).to_bytes(2, "little"))


@pytest.mark.parametrize("how", ["corrupt", "truncated", "stale", "disk_full"])
def test_disk_failures_recompute_with_one_warning(llama_disk, llama_off, how, monkeypatch, caplog):
    prompts = conversations(seed={"corrupt": 10, "truncated": 11, "stale": 12, "disk_full": 13}[how])
    turn1, turn2 = prompts[:3], prompts[3:]
    failed_before = tier_stats(llama_disk).failed_loads
    if how == "disk_full":
        from pagedllm.worker.kv_tier import block_files as files_mod

        def full(f, view):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(files_mod, "_write_all", full)
    old_files = set(block_files(llama_disk))
    with caplog.at_level(logging.WARNING, logger=DISK_LOGGER):
        got1 = one_by_one(llama_disk, turn1)
        files = set(block_files(llama_disk)) - old_files
        if how != "disk_full":
            assert files, "turn 1 left no block file"
            for p in files:
                damage(p, how)
        else:
            assert not files  # every write failed
        got2 = one_by_one(llama_disk, turn2)
    assert got1 + got2 == one_by_one(llama_off, prompts)
    assert tier_stats(llama_disk).failed_loads > failed_before  # the core was told, and recomputed
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == DISK_LOGGER]
    assert len(warned) == 1, warned
    assert {"corrupt": "corrupt", "truncated": "truncated", "stale": "stale", "disk_full": "disk is full"}[how] in warned[0]
    check_clean(llama_disk)


# ---- benchmarks/kv_offload.py end to end, tiny ------------------------------------------------
def test_kv_offload_benchmark_smoke(ckpts, tmp_path):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "benchmarks"))
    import kv_offload

    res = kv_offload.main(["--model", ckpts["llama"], "--conversations", "3", "--doc-len", "64", "--turns", "2",
                           "--user-len", "16-20", "--answer-len", "4", "--concurrency", "1", "--tier-gib", "0.004",
                           "--configs", "none,disk", "--offload-dir", str(tmp_path),
                           "--out", str(tmp_path / "kv.json")])
    by = {r["config"]: r for r in res["summary"]}
    assert set(by) == {"none", "disk"} and os.path.exists(tmp_path / "kv.json")
    assert by["none"].get("tier_hit_rate") is None and "ttft_p50 none/disk" in res["ratios"]
    # turn 2 of the conversations found their history in the tier, and nothing failed
    assert by["disk"]["tier_hit_rate"] > 0 and by["disk"]["tier_MiB_in"] > 0 and by["disk"]["tier_failed_loads"] == 0
