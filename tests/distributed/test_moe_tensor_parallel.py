"""Tensor parallelism over MoE: 2 ranks split every expert's intermediate dimension (and the
shared expert's) and give the same greedy tokens as 1, with about half the weights per rank."""
import os

import pytest

from prompts import random_prompts
from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")


def greedy(path, tp):
    llm = LLM(model=path, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)
    try:
        outs = llm.generate(prompt_token_ids=random_prompts((1, 9, 40, 75), seed=5), use_tqdm=False,
                            sampling_params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        weights = llm.engine.core.executor.weight_bytes_per_rank
    finally:
        llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], weights


def test_qwen2_moe_tp2_matches_tp1(make_ckpt):
    path = make_ckpt("tp_qwen2_moe", "qwen2_moe", extra=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48))
    one, w1 = greedy(path, 1)
    two, w2 = greedy(path, 2)
    assert two == one
    # experts dominate the weights; the router, norms and shared gate are replicated
    assert len(w2) == 2 and all(0.5 < w / w1[0] < 0.6 for w in w2)
