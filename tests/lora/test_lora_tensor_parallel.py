"""LoRA under tensor parallelism (2 CPU ranks, gloo): column-parallel layers hold their rank's
rows of B (q/k/v by heads), row-parallel ones their rank's columns of A with the shrunk
activations summed across ranks; the tokens equal one rank's and HF + PEFT's."""
import os

import pytest

from checkpoints import make_checkpoint
from peft_adapters import hf_peft_greedy, make_adapter
from prompts import random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")

NEW = 10
SP = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
PROMPTS = tuple(tuple(p) for p in random_prompts((7, 30), seed=13))


def run(base, tp, loras):
    llm = LLM(model=base, dtype="float32", kv_cache_memory=8 << 20, tensor_parallel_size=tp, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    try:
        items = [list(p) for p in PROMPTS] * len(loras)
        reqs = [lr for lr in loras for _ in PROMPTS]
        outs = llm.generate(prompt_token_ids=items, sampling_params=SP, lora_request=reqs, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: k/v heads replicated on both ranks
def test_tp2_matches_tp1_and_hf(tmp_path_factory, kv_heads):
    d = tmp_path_factory.mktemp(f"lora_tp{kv_heads}")
    base = make_checkpoint(str(d / "base"), "llama", heads=4, kv_heads=kv_heads)
    full = make_adapter(base, str(d / "full"), r=8, seed=7)
    part = make_adapter(base, str(d / "part"), r=4, targets=("k_proj", "o_proj", "up_proj"), use_rslora=True, seed=8)
    loras = [LoRARequest("full", 1, full), None, LoRARequest("part", 2, part)]
    two = run(base, 2, loras)
    assert two == run(base, 1, loras)
    want = [t for path in (full, None, part) for t in hf_peft_greedy(base, path, PROMPTS, NEW)]
    assert two == want
