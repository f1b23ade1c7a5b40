"""Seeds, n>1, stop strings / stop tokens / min_tokens / ignore_eos, penalties, abort and bad input."""
import pytest

from prompts import random_prompts
from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    return LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20, max_model_len=512)


def gen(llm, prompts, sp):
    return llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)


def assert_no_leak(llm):
    s = llm.get_stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == 0 and s.num_waiting == 0


def test_seeded_sampling_is_independent_of_batch(llm):
    target = random_prompts((12,), seed=1)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = gen(llm, [target], sp)[0].outputs[0].token_ids
    others = random_prompts((5, 30, 70), seed=2)
    mixed = gen(llm, others[:1] + [target] + others[1:], [SamplingParams(temperature=0.7, max_tokens=25, ignore_eos=True),
                                                         sp, SamplingParams(temperature=1.0, seed=9, max_tokens=5),
                                                         SamplingParams(temperature=0, max_tokens=8)])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = gen(llm, [target], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=4321, max_tokens=20, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone
    assert_no_leak(llm)


def test_n_greater_than_one(llm):
    p = random_prompts((40,), seed=5)[0]
    out = gen(llm, [p], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) > 1 and all(len(s) == 10 for s in seqs)
    greedy = gen(llm, [p], SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    assert_no_leak(llm)


def test_stop_token_ids_and_min_tokens(llm):
    p = random_prompts((20,), seed=6)[0]
    free = gen(llm, [p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    stop_tok = free[4]
    first = free.index(stop_tok)
    out = gen(llm, [p], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True))[0].outputs[0]
    assert out.token_ids == free[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens forbids the stop token until min_tokens tokens exist
    out = gen(llm, [p], SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 3, stop_token_ids=[stop_tok], ignore_eos=True))[0].outputs[0]
    assert stop_tok not in out.token_ids[: first + 3]
    assert len(out.token_ids) >= first + 3
    assert_no_leak(llm)


def test_eos_stops_unless_ignored(llm):
    p = random_prompts((20,), seed=6)[0]
    free = gen(llm, [p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    # Make token 2 (EOS) the only sensible choice at every step with a logit bias.
    out = gen(llm, [p], SamplingParams(temperature=0, max_tokens=20, logit_bias={2: 100.0}))[0].outputs[0]
    assert out.token_ids == [2] and out.finish_reason == "stop" and out.stop_reason is None
    out = gen(llm, [p], SamplingParams(temperature=0, max_tokens=5, logit_bias={2: 100.0}, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == [2] * 5 and out.finish_reason == "length"
    assert free != out.token_ids


def test_stop_strings_across_token_boundaries(llm):
    p = random_prompts((20,), seed=8)[0]
    full = gen(llm, [p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    words = full.text.split()
    assert len(words) >= 6
    # a stop string that starts inside token 3 and ends inside token 4
    stop = words[3][1:] + " " + words[4][:2]
    out = gen(llm, [p], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert len(out.token_ids) == 5
    out = gen(llm, [p], SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True, ignore_eos=True))[0].outputs[0]
    assert out.text.endswith(stop)
    assert_no_leak(llm)


def test_min_tokens_holds_back_stop_strings_too(llm):
    """A stop string completed before min_tokens is passed over (vLLM's rule), as a stop token is."""
    p = random_prompts((20,), seed=8)[0]
    full = gen(llm, [p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    stop = full.text.split()[1][:1]  # a character the text shows early (and maybe again later)
    early = gen(llm, [p], SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 6
    held = gen(llm, [p], SamplingParams(temperature=0, max_tokens=16, stop=[stop], min_tokens=6,
                                        ignore_eos=True))[0].outputs[0]
    assert len(held.token_ids) >= 6 and held.token_ids == full.token_ids[:len(held.token_ids)]
    assert stop in held.text and full.text.startswith(held.text)
    assert held.finish_reason == "length" or (held.finish_reason == "stop" and held.stop_reason == stop)
    assert_no_leak(llm)


def test_penalties_change_output_and_stay_valid(llm):
    p = random_prompts((30,), seed=9)[0]
    base = gen(llm, [p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].token_ids
    rep = gen(llm, [p], SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.8, ignore_eos=True))[0].outputs[0].token_ids
    freq = gen(llm, [p], SamplingParams(temperature=0, max_tokens=30, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True))[0].outputs[0].token_ids
    assert len(set(freq)) >= len(set(base))
    assert rep != base or freq != base


def test_bad_prompt_fails_alone(llm):
    engine = llm.engine
    good = engine.add_request(None, random_prompts((10,))[0], SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(None, [5] * 600, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(None, [5, 100000], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(None, [], SamplingParams(max_tokens=5))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [good] and len(done[0].outputs[0].token_ids) == 5
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(prompt_token_ids=[[5, 6], [7] * 600], use_tqdm=False)
    assert_no_leak(llm)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    rids = [engine.add_request(None, p, SamplingParams(max_tokens=100, ignore_eos=True)) for p in random_prompts((50, 80, 120))]
    engine.step()
    engine.step()
    assert llm.get_stats().num_free_blocks < llm.get_stats().num_total_blocks
    engine.abort_request(rids)
    assert not engine.has_unfinished_requests()
    assert_no_leak(llm)


def test_generate_accepts_all_prompt_shapes(llm):
    p = random_prompts((6,))[0]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = gen(llm, [p], sp)[0].outputs[0].token_ids
    b = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
    text = llm.get_tokenizer().decode(p)
    c = llm.generate(text, sp, use_tqdm=False)[0]
    assert a == b
    assert c.prompt == text and len(c.outputs[0].token_ids) == 4
