"""Beam search inside the engine against HF transformers' generate(num_beams=W) in float32 on a
tiny random Llama: the same beam_width sequences, in the same order, with the same scores; under
chunked prefill, preemption of whole groups, prefix caching and block sizes 1 / 4 / 16; blocks
shared between beams (counted), none leaked. best_of returns the n best of best_of samples."""
import pytest
import torch

from checkpoints import hf_model, make_checkpoint
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 9, 100, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("beam") / "llama"), "llama")


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_model(ckpt)


@pytest.fixture(scope="module")
def stop_tok(hf):
    """A token the beams meet early (the 3rd token of the first prompt's best beam): used as EOS,
    so hypotheses end by EOS as well as by length."""
    ids = torch.tensor([PROMPTS[0]])
    g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, num_beams=4, do_sample=False,
                    eos_token_id=None, pad_token_id=0)
    return int(g[0, -1])


def hf_beams(hf, prompt, width, max_tokens, eos, length_penalty, early_stopping):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, num_beams=width,
                        num_return_sequences=width, do_sample=False, eos_token_id=eos, pad_token_id=0,
                        length_penalty=length_penalty, early_stopping=early_stopping, output_scores=True,
                        return_dict_in_generate=True)
    scores = g.sequences_scores.tolist() if width > 1 else [None]  # num_beams=1 is HF's greedy path
    return [(g.sequences[i, len(prompt):].tolist(), scores[i]) for i in range(width)]


def assert_same(out, ref, prompt, eos=None):
    assert len(out.sequences) == len(ref)
    for seq, (hf_tokens, hf_score) in zip(out.sequences, ref):
        gen = seq.tokens[len(prompt):]
        assert hf_tokens[: len(gen)] == gen, (gen, hf_tokens)
        assert all(t == eos for t in hf_tokens[len(gen):]), (gen, hf_tokens)  # HF pads with EOS after it
        if hf_score is not None:
            assert seq.score == pytest.approx(hf_score, abs=1e-4, rel=1e-5)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=ckpt, dtype="float32", kv_cache_memory=8 << 20, block_size=4)


CASES = [  # width, eos reachable, length_penalty, early_stopping, max_tokens
    (1, False, 1.0, False, 10),
    (2, True, 1.0, False, 12),
    (4, True, 1.0, False, 12),
    (4, True, 2.0, "never", 10),
    (4, True, 0.0, True, 10),
    (8, True, -0.5, False, 8),
    (8, False, 1.0, False, 8),
]


@pytest.mark.parametrize("width,eos,lp,es,max_tokens", CASES)
def test_matches_hf(llm, hf, stop_tok, width, eos, lp, es, max_tokens):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True, length_penalty=lp,
                              early_stopping=es, stop_token_ids=[stop_tok] if eos else None)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    ended_by_eos = 0
    for p, out in zip(PROMPTS, outs):
        assert_same(out, hf_beams(hf, p, width, max_tokens, [stop_tok] if eos else None, lp, es), p, stop_tok)
        ended_by_eos += sum(s.finish_reason == "stop" for s in out.sequences)
    if eos and width > 1:
        assert ended_by_eos > 0  # the EOS path was exercised
    kv = llm.engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_width_one_is_greedy(llm):
    out = llm.beam_search({"prompt_token_ids": PROMPTS[1]}, BeamSearchParams(beam_width=1, max_tokens=10,
                                                                            ignore_eos=True))
    greedy = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=10,
                                                                              ignore_eos=True), use_tqdm=False)
    assert out[0].sequences[0].tokens[len(PROMPTS[1]):] == greedy[0].outputs[0].token_ids


@pytest.mark.parametrize("block_size,kv_mib,budget", [(1, 8, 2048), (16, 8, 2048), (4, 0.1, 9), (4, 0.065, 64)])
def test_pressure_chunking_and_block_sizes(ckpt, hf, stop_tok, block_size, kv_mib, budget):
    """A 9-token budget chunks the prompts (and groups wait for room to sample together); a
    33-block cache preempts whole groups, recomputed with prefix-cache hits."""
    llm = LLM(model=ckpt, dtype="float32", kv_cache_memory=int(kv_mib * (1 << 20)), block_size=block_size,
              max_num_batched_tokens=budget, max_num_seqs=16)
    prompts = PROMPTS + [PROMPTS[1][:13], PROMPTS[0] * 3]
    pressure = kv_mib < 0.1
    eos, n = (None, 10) if pressure else (stop_tok, 12)  # under pressure every beam runs to max_tokens
    params = BeamSearchParams(beam_width=4, max_tokens=n, ignore_eos=True, stop_token_ids=[eos] if eos else None)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        assert_same(out, hf_beams(hf, p, 4, n, [eos] if eos else None, 1.0, False), p, eos)
    stats = llm.get_stats()
    assert (stats.num_preemptions > 0) == pressure
    assert stats.num_free_blocks == stats.num_total_blocks


def test_blocks_shared_between_beams(llm):
    """Block use stays within prompt blocks + W x (generated blocks + 1), far below W copies."""
    engine, kv, bs, width, n = llm.engine, llm.engine.core.kv_cache_manager, 4, 4, 16
    prompt = PROMPTS[1]
    engine.add_request("share", {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=width, max_tokens=n,
                                                                               ignore_eos=True))
    peak, gen = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        used = kv.num_total_blocks - kv.num_free_blocks
        gen = max([r.num_output_tokens for r in engine.core.scheduler.running] + [gen])
        assert used <= -(-len(prompt) // bs) + width * (-(-gen // bs) + 1)
        peak = max(peak, used)
    independent = width * -(-(len(prompt) + n) // bs)  # 4 x 9 = 36 blocks without sharing
    assert peak <= 5 + width * 5 < independent
    assert kv.num_free_blocks == kv.num_total_blocks


def test_logprobs_and_stop_strings(llm):
    prompt = {"prompt_token_ids": PROMPTS[0]}
    base = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True, logprobs=2))[0]
    for seq in base.sequences:
        gen = seq.tokens[len(PROMPTS[0]):]
        assert len(seq.logprobs) == len(gen)
        assert all(t in d and len(d) >= 2 for t, d in zip(gen, seq.logprobs))
        assert sum(d[t].logprob for t, d in zip(gen, seq.logprobs)) == pytest.approx(seq.cum_logprob, abs=1e-4)
    word = base.sequences[0].text.split()[2]
    for include in (False, True):
        out = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True, stop=[word],
                                                       include_stop_str_in_output=include))[0]
        stopped = [s for s in out.sequences if s.finish_reason == "stop"]
        assert stopped and all(s.stop_reason == word for s in stopped)
        for s in stopped:
            assert s.text.endswith(word) if include else word not in s.text.split()


def test_bad_params_are_refused(llm):
    for kw, field in [({"beam_width": 0}, "beam_width"), ({"temperature": 0.7}, "temperature"),
                      ({"early_stopping": "sometimes"}, "early_stopping"), ({"logprobs": 50}, "logprobs")]:
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})
    with pytest.raises(ValueError, match="KV blocks"):
        llm.beam_search({"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(beam_width=100, max_tokens=1000))


def test_best_of_returns_the_best_mean_logprob(llm):
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    all5 = llm.generate(prompt, SamplingParams(n=5, temperature=1.0, seed=7, max_tokens=8, logprobs=0),
                        use_tqdm=False)[0].outputs
    best = llm.generate(prompt, SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=8),
                        use_tqdm=False)[0].outputs
    ranked = sorted(all5, key=lambda c: c.cumulative_logprob / len(c.token_ids), reverse=True)
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1] and best[0].logprobs is None
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_abort_mid_search_frees_every_block(llm):
    engine, kv = llm.engine, llm.engine.core.kv_cache_manager
    engine.add_request("gone", {"prompt_token_ids": PROMPTS[1]}, BeamSearchParams(beam_width=4, max_tokens=30,
                                                                                  ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert len(engine.core.scheduler.running) == 4 and kv.num_free_blocks < kv.num_total_blocks
    (out,) = engine.abort_request("gone")
    assert out.finished and len(out.outputs) == 4 and {c.finish_reason for c in out.outputs} == {"abort"}
    assert [len(c.token_ids) for c in out.outputs] == [5] * 4  # the live beams so far (a token a step), best first
    assert not engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_total_blocks
