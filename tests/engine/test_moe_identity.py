"""MoE families (and DeepSeek's MLA) give greedy outputs token-for-token identical to HF
transformers in float32, also under chunked prefill with block size 1, and under preemption
with prefix caching on and off (tiny random configs: hidden 64, 8 experts, top 2)."""
import functools

import pytest

from checkpoints import hf_greedy
from conftest import random_prompts
from pagedllm import LLM, SamplingParams

LENGTHS = (1, 3, 17, 40, 90)
NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

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
}


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


@pytest.mark.parametrize("name", list(CASES))
def test_block_size_one_chunked_prefill(make_ckpt, name):
    path = checkpoint(make_ckpt, name)
    got, _, _ = run(path, block_size=1, max_num_batched_tokens=16)
    assert got == reference(path)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("caching", [True, False])
def test_preemption(make_ckpt, name, caching):
    path = checkpoint(make_ckpt, name)
    got, stats, _ = run(path, PREEMPT_LENGTHS, num_gpu_blocks_override=9, max_model_len=128,
                        enable_prefix_caching=caching)
    assert stats.num_preemptions > 0
    assert got == reference(path, PREEMPT_LENGTHS)
