"""Automatic prefix caching: identical outputs on/off, fewer tokens computed, sharing, eviction."""
import random

import pytest

from prompts import random_prompts
from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def shared_prefix_prompts(n, prefix_len, suffix_len, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 512) for _ in range(suffix_len)] for _ in range(n)]


def generate(path, prompts, caching, one_by_one=False, **kw):
    kw.setdefault("kv_cache_memory", 32 << 20)
    llm = LLM(model=path, dtype="float32", enable_prefix_caching=caching, **kw)
    if one_by_one:
        outs = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    s = llm.get_stats()
    assert s.num_free_blocks == s.num_total_blocks
    llm.engine.core.kv_cache_manager.pool.check_consistency()
    return [o.outputs[0].token_ids for o in outs], s, llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_identical_on_and_off(make_ckpt, arch, block_size):
    path = make_ckpt(f"apc_{arch}", arch)
    prompts = shared_prefix_prompts(6, 70, 9) + random_prompts((33,))
    on, s_on, _ = generate(path, prompts, True, one_by_one=True, block_size=block_size)
    off, s_off, _ = generate(path, prompts, False, one_by_one=True, block_size=block_size)
    assert on == off
    assert s_on.prefix_cache_hits > 0 and s_on.num_scheduled_tokens_total < s_off.num_scheduled_tokens_total


def test_identical_under_eviction_and_preemption(llama_ckpt):
    prompts = shared_prefix_prompts(8, 120, 30, seed=1) + shared_prefix_prompts(8, 100, 20, seed=2)
    # ~40 blocks of 16 tokens: the cache must evict and preempt while prefixes are shared
    tight = dict(kv_cache_memory=512 * 16 * 40, max_model_len=512)
    on, s_on, _ = generate(llama_ckpt, prompts, True, **tight)
    off, _, _ = generate(llama_ckpt, prompts, False)
    assert on == off
    assert s_on.num_preemptions > 0


def test_abort_of_a_sharing_request_keeps_the_other_correct(llama_ckpt):
    prompts = shared_prefix_prompts(2, 64, 5, seed=4)
    ref, _, _ = generate(llama_ckpt, prompts[1:], False)
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20)
    eng = llm.engine
    a = eng.add_request(None, prompts[0], GREEDY)
    eng.step()
    b = eng.add_request(None, prompts[1], GREEDY)
    eng.step()
    eng.abort_request(a)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert outs[0].request_id == b and outs[0].outputs[0].token_ids == ref[0]
    assert outs[0].num_cached_tokens == 64
    s = llm.get_stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_second_request_skips_a_1000_token_system_prompt(make_ckpt):
    path = make_ckpt("apc_long", "llama", max_pos=2048)
    system = shared_prefix_prompts(1, 1000, 0, seed=5)[0]
    llm = LLM(model=path, dtype="float32", kv_cache_memory=64 << 20)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = llm.get_stats().num_scheduled_tokens_total
    first = llm.generate(prompt_token_ids=[system + [7, 8, 9]], sampling_params=sp, use_tqdm=False)[0]
    mid = llm.get_stats().num_scheduled_tokens_total
    second = llm.generate(prompt_token_ids=[system + [10, 11, 12, 13]], sampling_params=sp, use_tqdm=False)[0]
    after = llm.get_stats().num_scheduled_tokens_total
    assert mid - before == 1003 + 3  # prompt + 3 decode steps (the 4th token needs no forward)
    assert after - mid == (1004 - 992) + 3  # 62 full blocks (992 tokens) came from the cache
    assert second.num_cached_tokens == 992 and first.num_cached_tokens == 0
    s = llm.get_stats()
    assert s.prefix_cache_hits >= 992


def test_multi_turn_chat_reuses_turn_one(llama_ckpt):
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    turn1 = random_prompts((90,), seed=6)[0]
    out1 = llm.generate(prompt_token_ids=[turn1], sampling_params=sp, use_tqdm=False)[0].outputs[0].token_ids
    turn2 = turn1 + out1 + random_prompts((15,), seed=7)[0]
    mid = llm.get_stats().num_scheduled_tokens_total
    o2 = llm.generate(prompt_token_ids=[turn2], sampling_params=sp, use_tqdm=False)[0]
    # turn 1's prompt and all but the last answer token were cached (in full 16-token blocks)
    cached = (len(turn1) + len(out1) - 1) // 16 * 16
    assert o2.num_cached_tokens == cached
    assert llm.get_stats().num_scheduled_tokens_total - mid == len(turn2) - cached + 19


def test_n_samples_share_prompt_blocks(llama_ckpt):
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20)
    p = random_prompts((64,), seed=8)[0]
    llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=4), use_tqdm=False)
    s = llm.get_stats()
    # one child computes the 64-token prompt; the other three hit 3 full blocks (48 tokens) each
    assert s.prefix_cache_hits == 3 * 48
    assert s.num_free_blocks == s.num_total_blocks


def test_reset_prefix_cache(llama_ckpt):
    prompts = shared_prefix_prompts(2, 64, 4, seed=9)
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY, use_tqdm=False)
    assert llm.reset_prefix_cache()
    out = llm.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
