"""Tensor parallelism over the dense families whose loading or layers have TP-specific parts:
Phi-3's fused qkv / gate_up tensors split per rank, OLMo 2's q/k norm over the whole projection
(squared sums all-reduced), GPT-2's transposed Conv1D c_attn split into q/k/v; Falcon-RW's
per-head fused q/k/v (index views) and its ALiBi slopes split by head, StableLM's per-head
q/k norm tensors, Cohere's permuted q/k rows and [heads, head_dim] norms, GPTBigCode's one kv
head replicated. 2 ranks give the same greedy tokens as 1."""
import os

import pytest

from prompts import random_prompts
from dense_checkpoints import make_dense_checkpoint
from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")


def greedy(path, tp):
    llm = LLM(model=path, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=8 << 20,
              max_num_batched_tokens=32)
    try:
        outs = llm.generate(prompt_token_ids=random_prompts((3, 40, 90), seed=8), use_tqdm=False,
                            sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        weights = llm.engine.core.executor.weight_bytes_per_rank
    finally:
        llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], weights


@pytest.mark.parametrize("family", ["phi3", "olmo2", "gpt2", "falcon_alibi", "stablelm", "cohere",
                                    "gpt_bigcode"])
def test_tp2_matches_tp1(ckpt_dir, family):
    path = make_dense_checkpoint(str(ckpt_dir / f"tp_dense_{family}"), family)
    one, w1 = greedy(path, 1)
    two, w2 = greedy(path, 2)
    assert two == one
    assert len(w2) == 2 and all(w < 0.8 * w1[0] for w in w2)
