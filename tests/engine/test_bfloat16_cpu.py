"""bfloat16 on CPU end to end: packed GEMMs (float32 products of bf16 values where the CPU has no
native bf16), bf16 KV cache read by the C++ decode kernel, fused bf16 elementwise ops. Greedy
output agrees with HF transformers in bfloat16 wherever the choice is clear; no blocks leak."""
import pytest
import torch

from checkpoints import assert_greedy_agrees, make_checkpoint
from prompts import random_prompts
from pagedllm import LLM, SamplingParams

NEW = 24


def hf_bf16_greedy(path, prompts):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_greedy_agrees_with_hf_bfloat16(tmp_path_factory, arch):
    path = make_checkpoint(str(tmp_path_factory.getbasetemp() / f"bf16-{arch}"), arch, hidden=128, heads=4,
                           kv_heads=2, intermediate=256, tie=arch == "qwen3")
    prompts = random_prompts((1, 9, 40, 130), seed=11)
    llm = LLM(model=path, dtype="bfloat16", kv_cache_memory=16 << 20)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2))
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert_greedy_agrees(outs, hf_bf16_greedy(path, prompts))
