"""Draft-model speculative decoding end to end: greedy output token-identical to no speculation
(a tiny random draft that is mostly rejected, and the target itself as draft, always accepted)
under chunked prefill, prefix caching, preemption and block sizes 1 and 16; sampled output on a
tiny-vocabulary model follows the target's exact next-token distribution at drafted positions
(chi-square, fixed seeds); penalties and min_tokens see the earlier drafts."""

import pytest

from pagedllm import LLM, SamplingParams
from prompts import random_prompts
from spec_runs import GREEDY, assert_second_tokens_follow_the_target, run, spec_config


def spec(draft, k=3, **kw):
    return spec_config("draft_model", draft, k, **kw)


@pytest.fixture(scope="module")
def small_draft(make_ckpt):
    return make_ckpt("draft_small", "llama", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=1)


@pytest.fixture(scope="module")
def reference(llama_ckpt):
    prompts = random_prompts((9, 30, 17, 41))
    return prompts, run(llama_ckpt, prompts)[0]


@pytest.mark.parametrize("kw", [
    dict(block_size=16),
    dict(block_size=1, max_num_batched_tokens=20),  # chunked prefill
    dict(block_size=16, kv_cache_memory=2 * 512 * 16 * 12, max_model_len=96),  # preemption (12 blocks, both caches)
], ids=["bs16", "bs1-chunked", "preempt"])
def test_greedy_identical_self_draft(llama_ckpt, reference, kw):
    prompts, ref = reference
    toks, s = run(llama_ckpt, prompts, speculative_config=spec(llama_ckpt), **kw)
    assert toks == ref
    assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens > 0  # the target drafting for itself
    if "max_model_len" in kw:
        assert s.num_preemptions > 0


def test_greedy_identical_small_draft_and_prefix_cache(llama_ckpt, small_draft, reference):
    prompts, ref = reference
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20, block_size=4,
              speculative_config=spec(small_draft, 4))
    for _ in range(2):  # the second round starts from cached prefixes
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    s = llm.get_stats()
    assert s.prefix_cache_hits > 0 and s.num_free_blocks == s.num_total_blocks
    assert s.spec_num_draft_tokens > s.spec_num_accepted_tokens  # rejections happened


def test_penalties_and_min_tokens_see_the_drafts(llama_ckpt, reference):
    prompts, _ = reference
    sp = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=8)
    base, _ = run(llama_ckpt, prompts, sp)
    toks, s = run(llama_ckpt, prompts, sp, speculative_config=spec(llama_ckpt))
    assert toks == base and s.spec_num_accepted_tokens > 0


def test_draft_vocabulary_must_match(llama_ckpt, make_ckpt):
    other = make_ckpt("draft_vocab", "llama", vocab_size=256, layers=1)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model=llama_ckpt, kv_cache_memory=16 << 20, speculative_config=spec(other))


def test_sampled_drafted_positions_follow_the_target(make_ckpt):
    """Tiny vocabulary: the exact p(token 2 | prompt, token 1) comes from HF; token 2 is the
    drafted position (a different random draft model proposes it, so q != p)."""
    vocab = 8
    target = make_ckpt("tiny_vocab_target", "llama", vocab_size=vocab, layers=1, hidden=32, heads=2, kv_heads=1,
                       intermediate=64, init_std=0.6, seed=3)
    draft = make_ckpt("tiny_vocab_draft", "llama", vocab_size=vocab, layers=1, hidden=32, heads=2, kv_heads=1,
                      intermediate=64, init_std=0.6, seed=4)
    prompt = [3, 5, 4, 6, 3, 7]
    n = 1500
    llm = LLM(model=target, dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=256, seed=11,
              speculative_config=spec(draft, 1, auto_disable=False))  # every token 2 drafted
    outs = llm.generate(prompt_token_ids=[prompt] * n,
                        sampling_params=SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    s = llm.get_stats()
    assert s.spec_num_drafts == n and 0 < s.spec_num_accepted_tokens < n  # every token 2 was drafted; some rejected
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    assert_second_tokens_follow_the_target(pairs, target, prompt, vocab)
