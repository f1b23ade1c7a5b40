"""N-gram speculative decoding end to end: greedy output token-identical to no speculation (and
to HF once) under chunked prefill, prefix caching, preemption and block sizes 1 and 16; no leaked
blocks after rejections; max_tokens, stop tokens and stop strings exact; counters consistent."""
import random

import pytest

from pagedllm import LLM, SamplingParams

# auto_disable off: the governor's timing-driven plain steps would make the draft counts below vary
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "auto_disable": False}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def repetitive_prompts(n, seed=0, vocab=512):
    """Prompts that repeat a random phrase: the model's continuation often copies it."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 12))]
        out.append((phrase * 4)[: rng.randrange(25, 45)])
    return out


def run(path, prompts, params=GREEDY, spec=None, **kw):
    kw.setdefault("kv_cache_memory", 32 << 20)
    llm = LLM(model=path, dtype="float32", speculative_config=spec, **kw)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    s = llm.get_stats()
    assert s.num_free_blocks == s.num_total_blocks  # nothing leaked, rejected drafts' blocks included
    llm.engine.core.kv_cache_manager.pool.check_consistency()
    return outs, s


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(llama_ckpt):
    prompts = repetitive_prompts(6)
    return prompts, tokens(run(llama_ckpt, prompts)[0])


@pytest.mark.parametrize("kw", [
    dict(block_size=16),
    dict(block_size=1),
    dict(block_size=16, max_num_batched_tokens=24, enable_prefix_caching=False),  # chunked prefill, budget caps drafts
    dict(block_size=16, kv_cache_memory=512 * 16 * 12, max_model_len=128),  # preemption
], ids=["bs16", "bs1", "chunked", "preempt"])
def test_greedy_identical_to_no_speculation(llama_ckpt, reference, kw):
    prompts, ref = reference
    outs, s = run(llama_ckpt, prompts, spec=NGRAM, **kw)
    assert tokens(outs) == ref
    assert s.spec_num_accepted_tokens > 0 and s.spec_num_draft_tokens > s.spec_num_accepted_tokens  # both paths ran
    if "kv_cache_memory" in kw:
        assert s.num_preemptions > 0


def test_prefix_cache_hits_and_speculation(llama_ckpt, reference):
    prompts, ref = reference
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=32 << 20, speculative_config=NGRAM, block_size=4)
    for _ in range(2):  # the second round hits blocks the first one (with its rejections) cached
        assert tokens(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)) == ref
    s = llm.get_stats()
    assert s.prefix_cache_hits > 0 and s.num_free_blocks == s.num_total_blocks


def test_matches_hf(llama_ckpt):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = repetitive_prompts(1, seed=3)[0]
    outs, s = run(llama_ckpt, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), spec=NGRAM)
    hf = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert outs[0].outputs[0].token_ids == ref and s.spec_num_draft_tokens > 0


def test_max_tokens_and_stops_exact(llama_ckpt, reference):
    prompts, ref = reference
    for max_tokens in (1, 2, 3, 7):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs, _ = run(llama_ckpt, prompts, sp, spec=NGRAM)
        assert tokens(outs) == [r[:max_tokens] for r in ref]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # a stop token in the middle of accepted drafts: nothing after it is emitted
    stop = ref[0][10]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    base, _ = run(llama_ckpt, prompts[:1], sp)
    outs, _ = run(llama_ckpt, prompts[:1], sp, spec=NGRAM)
    assert tokens(outs) == tokens(base) and outs[0].outputs[0].token_ids[-1] == stop
    assert outs[0].outputs[0].finish_reason == "stop"


def test_stop_string_drops_later_tokens(llama_ckpt):
    from tokenizers import Tokenizer  # noqa: F401  (the checkpoint's word-level tokenizer)

    prompt = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6 w7"
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=32 << 20)
    full = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    stop = " ".join(words[4:6])
    sp_stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    base = llm.generate([prompt], sp_stop, use_tqdm=False)[0].outputs[0]
    spec_llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=32 << 20, speculative_config=NGRAM)
    out = spec_llm.generate([prompt], sp_stop, use_tqdm=False)[0].outputs[0]
    assert out.text == base.text and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == base.token_ids


def test_counters_consistent(llama_ckpt, reference):
    prompts, ref = reference
    outs, s = run(llama_ckpt, prompts, spec=NGRAM)
    assert sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens
    assert list(s.spec_accepted_per_pos) == sorted(s.spec_accepted_per_pos, reverse=True)
    assert s.spec_num_drafts <= s.spec_num_draft_tokens <= 4 * s.spec_num_drafts
    # every step emits one token per decoding request plus the accepted drafts
    generated = sum(len(t) for t in tokens(outs))
    assert generated < len(prompts) * 40 + 1 and s.spec_num_accepted_tokens <= generated - len(prompts)


def test_sampled_requests_with_logprobs_and_n(llama_ckpt, reference):
    prompts, _ = reference
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, logprobs=2, n=2, seed=5)
    outs, s = run(llama_ckpt, prompts[:3], sp, spec=NGRAM)
    for o in outs:
        assert len(o.outputs) == 2
        for c in o.outputs:
            assert len(c.token_ids) == 20 and len(c.logprobs) == 20
            assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    again, _ = run(llama_ckpt, prompts[:3], sp, spec=NGRAM)  # seeded: reproducible
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in again]


def test_bad_config_is_a_clear_error(llama_ckpt):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=llama_ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="method"):
        LLM(model=llama_ckpt, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown field"):
        LLM(model=llama_ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "k": 1})
    with pytest.raises(ValueError, match="checkpoint directory with a config.json for method 'eagle'"):
        LLM(model=llama_ckpt, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
