"""A Mistral-style model (every layer windowed alike) frees the blocks behind the window while it
runs: greedy output stays token-identical to HF transformers under chunked prefill, preemption,
prefix caching and block sizes 1 and 16, and a KV cache far smaller than one full sequence still
serves prompts many times the window."""
import functools

import pytest

from checkpoints import hf_greedy
from prompts import random_prompts
from pagedllm import LLM, SamplingParams

WINDOW = 24
LENGTHS = (5, 40, 130, 260)
NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
# 2 layers * 2 kv heads * 16 dims * 4 bytes * 2 (K, V) = 512 bytes per token in float32.
BYTES_PER_TOKEN = 512


@pytest.fixture(scope="module")
def mistral_sw(make_ckpt):
    return make_ckpt("mistral_sw24", "mistral", sliding_window=WINDOW)


@functools.lru_cache(maxsize=None)
def reference(path):
    return hf_greedy(path, random_prompts(LENGTHS, seed=5), NEW)


def run(path, **kw):
    llm = LLM(model=path, dtype="float32", **kw)
    outs = llm.generate(prompt_token_ids=random_prompts(LENGTHS, seed=5), sampling_params=GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    return llm, [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("block_size", [1, 16])
def test_window_freeing_matches_hf(mistral_sw, block_size):
    llm, got, _ = run(mistral_sw, block_size=block_size, kv_cache_memory=8 << 20, max_num_batched_tokens=32)
    assert llm.engine.core.kv_cache_manager.sliding_window == WINDOW
    assert got == reference(mistral_sw)


def test_a_cache_smaller_than_one_sequence_serves_long_prompts(mistral_sw):
    # 8 blocks of 16 tokens = 128 tokens of cache, for prompts up to 260 + 24 tokens; the
    # window (24) plus a chunk (32) needs at most 5 blocks per sequence: preemption, not refusal.
    llm, got, stats = run(mistral_sw, block_size=16, kv_cache_memory=8 * 16 * BYTES_PER_TOKEN,
                          max_num_batched_tokens=32, max_model_len=512)
    assert stats.num_total_blocks == 8
    assert got == reference(mistral_sw)


def test_warm_prefix_cache_equals_cold(mistral_sw):
    llm, cold, _ = run(mistral_sw, block_size=4, kv_cache_memory=8 << 20, max_num_batched_tokens=32)
    warm = llm.generate(prompt_token_ids=random_prompts(LENGTHS, seed=5), sampling_params=GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in warm] == cold == reference(mistral_sw)
