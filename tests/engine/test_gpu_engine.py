"""End to end on a CUDA GPU (skipped without one): greedy outputs agree with HF transformers on
the same GPU, with CUDA graphs and with enforce_eager. Token identity is required wherever the
top-2 margin is clear (``assert_greedy_agrees``: the issue's float tolerance rule)."""
import pytest
import torch

from checkpoints import assert_greedy_agrees, make_checkpoint
from prompts import random_prompts
from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW = 32


def hf_greedy_on_gpu(path, prompts, dtype):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_matches_hf_on_gpu(tmp_path_factory, dtype, enforce_eager):
    path = make_checkpoint(str(tmp_path_factory.getbasetemp() / "gpu-llama"), "llama", vocab_size=512, hidden=128,
                           layers=2, heads=4, kv_heads=2, intermediate=256)
    prompts = random_prompts((1, 7, 33, 150, 300), seed=3)
    llm = LLM(model=path, device="cuda", dtype=dtype, enforce_eager=enforce_eager, gpu_memory_utilization=0.3,
              max_num_seqs=16)  # graphs for batch sizes 1, 2, 4, 8, 16
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    ref = hf_greedy_on_gpu(path, prompts, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    assert_greedy_agrees(outs, ref)
    llm.engine.shutdown()
