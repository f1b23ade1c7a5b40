"""Speculation switched on and off mid-request (the governor's plain steps) changes no greedy
token, for n-gram and for a draft model, whose KV cache then has to catch up on the tokens it
skipped; nothing leaks."""
import pytest

from pagedllm import LLM, SamplingParams
from prompts import random_prompts
from test_governor import Scripted

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# on 2, off 3, on 1, off 1, on 4, off 5: runs of plain steps of several lengths between speculative ones
SCRIPT = [True, True, False, False, False, True, False, True, True, True, True, False, False, False, False, False]


def generate(path, prompts, spec=None, script=None, **kw):
    llm = LLM(model=path, dtype="float32", kv_cache_memory=16 << 20, speculative_config=spec, **kw)
    if script is not None:
        llm.engine.core.scheduler.spec_governor = gov = Scripted(script)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    s = llm.get_stats()
    assert s.num_free_blocks == s.num_total_blocks
    llm.engine.core.kv_cache_manager.pool.check_consistency()
    if script is not None:
        assert False in gov.marked and True in gov.marked  # both modes ran
    return [o.outputs[0].token_ids for o in outs], s


@pytest.fixture(scope="module")
def reference(llama_ckpt):
    prompts = random_prompts((9, 30, 17)) + [([5, 6, 7, 8, 9] * 6)[:27]]  # the last one repeats: n-grams hit
    return prompts, generate(llama_ckpt, prompts)[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model_self", "draft_model_small"])
def test_greedy_identical_with_speculation_toggling(llama_ckpt, make_ckpt, reference, method):
    prompts, ref = reference
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:  # the target as its own draft accepts every draft whose K/V it computed right
        draft = llama_ckpt if method == "draft_model_self" else make_ckpt(
            "draft_small", "llama", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=1)
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    toks, s = generate(llama_ckpt, prompts, spec, SCRIPT, block_size=4)
    assert toks == ref
    assert s.spec_num_draft_tokens > 0
    if method == "draft_model_self":  # a stale draft cache after the plain stretches would reject some
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
