"""The host KV offload tier end to end on a deliberately tiny device KV cache: greedy outputs are
identical with and without it (prefix hits served from the tier, requests preempted and resumed
from it, failed loads recomputed), no block or tier slot leaks, and the tier is really used."""
import random

import pytest

from pagedllm import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# 12 blocks of 16 tokens: two ~100-token conversations fit; the next ones evict them. 32-token
# chunks let a second request in beside a running one, so growing outputs preempt.
TINY = dict(dtype="float32", num_gpu_blocks_override=12, max_model_len=192, max_num_seqs=4,
            max_num_batched_tokens=32)
TIER = dict(kv_offloading_size=2 / 1024)  # 2 MiB: ~250 blocks of this model


def conversations(seed=0, n=4, doc_len=84):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(doc_len)] for _ in range(n)]


def run(path, setup=None, **kw):
    """Turn 1 of every conversation one by one, then turn 2 (each re-asks its whole history,
    evicted from the device by the others meanwhile), then four new questions at once with long
    answers (too many for the cache: requests are preempted and resumed)."""
    llm = LLM(model=path, **TINY, **kw)
    if setup is not None:
        setup(llm)
    docs = conversations()
    gen = lambda prompts, sp=SP: [o.outputs[0].token_ids for o in
                                  llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    first = [gen([d + [5, 6, 7]])[0] for d in docs]
    second_prompts = [d + [5, 6, 7] + list(a) + [9, 10] for d, a in zip(docs, first)]
    second = [gen([p])[0] for p in second_prompts]
    batched = gen([d + [5, 6] for d in docs[::-1]], LONG)
    core = llm.engine.core
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    core.kv_cache_manager.pool.check_consistency()
    if core.kv_cache_manager.tier is not None:
        core.kv_cache_manager.tier.check_consistency()
        assert not core.kv_cache_manager.tier.index._pins
    return (first, second, batched), stats, llm


@pytest.fixture(scope="module")
def reference(llama_ckpt):
    outs, stats, llm = run(llama_ckpt)
    llm.shutdown()
    return outs, stats


def test_identical_with_the_host_tier(llama_ckpt, reference):
    outs, stats, llm = run(llama_ckpt, **TIER)
    llm.shutdown()
    assert outs == reference[0]
    tier = stats.kv_tier
    assert tier.stored_blocks > 0 and tier.loaded_blocks > 0 and tier.failed_loads == 0
    assert tier.hit_tokens >= 4 * 5 * 16  # turn 2 of each conversation: its document came back from the tier
    assert stats.num_preemptions > 0  # the batched part preempted and resumed
    assert stats.num_scheduled_tokens_total < reference[1].num_scheduled_tokens_total  # less recomputed
    from pagedllm.metrics.prometheus import PrometheusMetrics

    metrics = PrometheusMetrics("m")
    metrics.update_stats(stats)
    text = metrics.render(stats)[0].decode()
    assert f'pagedllm:external_prefix_cache_hits_total{{engine="0",model_name="m"}} {float(tier.hit_tokens)}' in text
    assert f'pagedllm:kv_offload_loaded_bytes_total{{model_name="m"}} {float(tier.loaded_blocks * tier.bytes_per_block)}' in text


def test_failed_loads_are_recomputed_with_the_same_output(llama_ckpt, reference):
    def inject(llm):  # every other batch of loads: its second block is "corrupt"
        store = llm.engine.core.executor.worker.kv_tier.store
        real_get, calls = store.get, [0]

        def flaky_get(slots, hashes, out):
            ok = real_get(slots, hashes, out)
            calls[0] += 1
            if calls[0] % 2 and len(ok) > 1:
                ok[1] = False
            return ok

        store.get = flaky_get

    outs, stats, llm = run(llama_ckpt, setup=inject, **TIER)
    llm.shutdown()
    assert outs == reference[0]
    assert stats.kv_tier.failed_loads > 0 and stats.kv_tier.loaded_blocks > 0


def test_the_tier_flags_are_checked():
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLM(model="/nonexistent", kv_offloading_size=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(model="/nonexistent", kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        LLM(model="/nonexistent", kv_offloading_size=1, kv_offloading_backend="tape")
