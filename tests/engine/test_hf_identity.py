"""Greedy outputs are token-for-token identical to HF transformers (float32), in every
architecture, and stay identical under stress: preemption, chunking, block sizes, max_num_seqs 1."""
import functools

import pytest
import torch

from checkpoints import hf_greedy, hf_model
from prompts import random_prompts
from pagedllm import LLM, SamplingParams

LENGTHS = (1, 3, 17, 64, 150, 300)
NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def reference(path: str, lengths=LENGTHS, seed=0):
    return hf_greedy(path, random_prompts(lengths, seed=seed), NEW)


def run(path, lengths=LENGTHS, seed=0, **kw):
    kw.setdefault("kv_cache_memory", 32 << 20)
    llm = LLM(model=path, dtype="float32", **kw)
    outs = llm.generate(prompt_token_ids=random_prompts(lengths, seed=seed), sampling_params=GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs], stats


ARCH_CASES = {
    "llama": dict(arch="llama"),
    "llama_tied_llama3_rope": dict(arch="llama", tie=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "mistral": dict(arch="mistral"),
    "mistral_sliding_window": dict(arch="mistral", sliding_window=40),
    "qwen2": dict(arch="qwen2", rope_theta=1000000.0),
    "qwen3": dict(arch="qwen3", tie=True),
    "llama_mha_sharded": dict(arch="llama", kv_heads=4, shards=3),
}


@pytest.mark.parametrize("name", list(ARCH_CASES))
def test_matches_hf(make_ckpt, name):
    case = dict(ARCH_CASES[name])
    path = make_ckpt(name, case.pop("arch"), **case)
    got, _ = run(path)
    assert got == reference(path)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_block_sizes(llama_ckpt, block_size):
    got, _ = run(llama_ckpt, block_size=block_size)
    assert got == reference(llama_ckpt)


def test_small_token_budget_chunks_every_prompt(llama_ckpt):
    got, stats = run(llama_ckpt, max_num_batched_tokens=7)
    assert got == reference(llama_ckpt)


def test_max_num_seqs_one(llama_ckpt):
    got, stats = run(llama_ckpt, max_num_seqs=1)
    assert got == reference(llama_ckpt)
    assert stats.num_batched_reqs_max == 1


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_under_a_tiny_cache(llama_ckpt, caching):
    # 2 layers * 2 kv heads * 16 dims * 4 bytes * 2 (K,V) = 512 B per token -> 1024 tokens of cache:
    # far less than the 6 prompts + 32 outputs need together at once.
    block_bytes = 512 * 16
    got, stats = run(llama_ckpt, kv_cache_memory=block_bytes * 40, max_model_len=640,
                     enable_prefix_caching=caching)
    assert stats.num_preemptions > 0
    assert got == reference(llama_ckpt)


def test_sampled_logprobs_match_hf_log_softmax(llama_ckpt):
    prompts = random_prompts((5, 40), seed=3)
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20)
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=12, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    m = hf_model(llama_ckpt)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        full = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(m(full).logits[0].float(), dim=-1)
        total = 0.0
        for j, (tok, lps) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(p) - 1 + j]
            assert abs(lps[tok].logprob - row[tok].item()) < 1e-4
            assert lps[tok].rank == int((row > row[tok]).sum()) + 1
            top = row.topk(5)
            for tid, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(lps[tid].logprob - v) < 1e-4
            total += row[tok].item()
        assert abs(c.cumulative_logprob - total) < 1e-3
        # prompt logprobs: position 0 has none, then each prompt token given its prefix
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        for j in range(1, len(p)):
            assert abs(o.prompt_logprobs[j][p[j]].logprob - ref[j - 1][p[j]].item()) < 1e-4
