"""N-gram speculative decoding under tensor parallelism: 2 ranks give the tokens of 1 rank
(greedy and seeded sampling; rank 0 samples and broadcasts the accepted tokens), no leaks."""
import os
import random

import pytest

from pagedllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "auto_disable": False}


def repetitive_prompts(n, seed=0, vocab=512):
    """As in test_ngram_engine.py: a random phrase repeated, cut at 25-44 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 12))]
        out.append((phrase * 4)[: rng.randrange(25, 45)])
    return out

pytestmark = [pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores"), pytest.mark.slow]


def generate(path, tp, sp):
    llm = LLM(model=path, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=16 << 20, speculative_config=NGRAM)
    try:
        outs = llm.generate(prompt_token_ids=repetitive_prompts(6), sampling_params=sp, use_tqdm=False)
        stats = llm.get_stats()
    finally:
        llm.engine.shutdown()
    assert stats.num_free_blocks == stats.num_total_blocks
    return [o.outputs[0].token_ids for o in outs], stats


def test_tp2_matches_tp1(llama_ckpt):
    for sp in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
               SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)):
        one, _ = generate(llama_ckpt, 1, sp)
        two, s = generate(llama_ckpt, 2, sp)
        assert one == two and s.spec_num_draft_tokens > 0
        if sp.temperature == 0:
            assert s.spec_num_accepted_tokens > 0
