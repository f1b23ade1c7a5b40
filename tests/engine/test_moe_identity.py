"""MoE families (and DeepSeek's MLA) give greedy outputs token-for-token identical to HF
transformers in float32, also under chunked prefill with block size 1, and under preemption
with prefix caching on and off (tiny random configs: hidden 64, 8 experts, top 2)."""
import functools

import pytest

from checkpoints import hf_greedy
from prompts import random_prompts
from pagedllm import LLM, SamplingParams

LENGTHS = (1, 3, 17, 40, 90)
NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

DEEPSEEK = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32,
                q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
CASES = {
    # always renormalised, 8 experts top 2
    "mixtral": dict(arch="mixtral", extra=dict(num_local_experts=8, num_experts_per_tok=2)),
    # shared expert + its sigmoid gate, no renormalisation, layer 0 dense (mlp_only_layers)
    "qwen2_moe": dict(arch="qwen2_moe", layers=3, extra=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, mlp_only_layers=[0])),
    # renormalised top 2, q/k norms, every other layer sparse (decoder_sparse_step 2)
    "qwen3_moe": dict(arch="qwen3_moe", layers=3, extra=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=2)),
    # MLA (q and kv low-rank, interleaved rope) + DeepSeek-V3 routing: layer 0 dense, then MoE with
    # grouped sigmoid top-2 (4 groups, best 2), correction bias, scaling 2.5 and one shared expert
    "deepseek_v3": dict(arch="deepseek_v3", layers=3, kv_heads=4, extra=DEEPSEEK),
    # no q low-rank, plain (non-interleaved) rope, ungrouped routing without renormalisation
    "deepseek_v3_plain": dict(arch="deepseek_v3", layers=2, kv_heads=4, extra=dict(
        DEEPSEEK, q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False)),
}


STRESSED = [name for name in CASES if name != "deepseek_v3_plain"]  # its variants are covered by the identity run
PREEMPT_LENGTHS = (40, 41, 42, 43)  # 3 blocks each; 9 blocks hold three, and growing past 48 preempts


@functools.lru_cache(maxsize=None)
def reference(path: str, lengths=LENGTHS):
    return hf_greedy(path, random_prompts(lengths), NEW)


def run(path, lengths=LENGTHS, **kw):
    kw.setdefault("kv_cache_memory", 8 << 20)
    llm = LLM(model=path, dtype="float32", **kw)
    outs = llm.generate(prompt_token_ids=random_prompts(lengths), sampling_params=GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs], stats, llm


def checkpoint(make_ckpt, name):
    case = dict(CASES[name])
    return make_ckpt(f"moe_{name}", case.pop("arch"), **case)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_hf(make_ckpt, name):
    path = checkpoint(make_ckpt, name)
    got, _, _ = run(path)
    assert got == reference(path)


@pytest.mark.parametrize("name", STRESSED)
def test_block_size_one_chunked_prefill(make_ckpt, name):
    path = checkpoint(make_ckpt, name)
    got, _, _ = run(path, block_size=1, max_num_batched_tokens=16)
    assert got == reference(path)


@pytest.mark.parametrize("name", STRESSED)
@pytest.mark.parametrize("caching", [True, False])
def test_preemption(make_ckpt, name, caching):
    path = checkpoint(make_ckpt, name)
    got, stats, _ = run(path, PREEMPT_LENGTHS, num_gpu_blocks_override=9, max_model_len=128,
                        enable_prefix_caching=caching)
    assert stats.num_preemptions > 0
    assert got == reference(path, PREEMPT_LENGTHS)


def test_deepseek_v3_yarn_matches_hf(make_ckpt):
    """YaRN past original_max_position_embeddings (64): scaled rope frequencies, cos/sin scaled by
    mscale / mscale_all_dim, and mscale_all_dim's square in the softmax scale."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    path = make_ckpt("moe_deepseek_v3_yarn", "deepseek_v3", layers=2, kv_heads=4, max_pos=256,
                     extra=dict(DEEPSEEK, rope_parameters=yarn))
    got, _, _ = run(path)
    assert got == reference(path)


def test_mla_caches_one_small_vector_per_token(make_ckpt):
    """The latent cache: one plane of kv_lora_rank + qk_rope_head_dim per token and layer, far below
    what the same attention would cache as MHA (K and V for every head)."""
    path = checkpoint(make_ckpt, "deepseek_v3")
    _, _, llm = run(path)
    worker = llm.engine.core.executor.worker
    spec = worker.kv_spec
    assert (spec.planes, spec.num_kv_heads, spec.head_dim) == (1, 1, 32 + 8)
    assert tuple(worker.kv_cache.shape[:2]) == (1, 3) and worker.kv_cache.shape[-1] == 40
    mha = worker.model.mha_kv_elements_per_token() * 4  # 3 layers x 4 heads x (24 + 16), float32
    assert spec.bytes_per_token == 3 * 40 * 4 and spec.bytes_per_token * 4 == mha  # 4x here
    # at DeepSeek-V3's own shape (128 heads, 192 + 128 dims, R 512 + 64) it is 71x
    assert 128 * (192 + 128) / (512 + 64) > 70


@pytest.mark.parametrize("name", STRESSED)
def test_prefix_cache_hits_give_the_same_tokens(make_ckpt, name):
    """The same prompts again on one engine: their full blocks come from the prefix cache (for
    MLA, cached latent rows) and the tokens still equal HF's."""
    path = checkpoint(make_ckpt, name)
    llm = LLM(model=path, dtype="float32", kv_cache_memory=8 << 20)
    for _ in range(2):
        outs = llm.generate(prompt_token_ids=random_prompts(LENGTHS), sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(path)
    stats = llm.get_stats()
    assert stats.prefix_cache_hits >= 16 + 32 + 80  # the 17-, 40- and 90-token prompts' full blocks
