"""A generate beside two busy processes on the same cores finishes within a generous bound of the
same generate without them (issue 30: libgomp's spinning threads once made it 10-25x slower)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

BUSY_LOOP = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end:\n    pass\n"


def _timed_generate(llm, prompts, sp) -> float:
    t = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == sp.max_tokens for o in outs)
    return dt


def test_generate_beside_two_busy_neighbours(llama_ckpt):
    from pagedllm import LLM, SamplingParams

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no OpenMP partner to wait for")
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20, skip_tokenizer_init=True)
    prompts = [[3 + (5 * i + j) % 500 for j in range(8)] for i in range(16)]
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    _timed_generate(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    alone = min(_timed_generate(llm, prompts, sp) for _ in range(2))
    neighbours = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(2)]  # inherit our CPUs
    try:
        busy = _timed_generate(llm, prompts, sp)
    finally:
        for p in neighbours:
            p.kill()
        for p in neighbours:
            p.wait()
    llm.engine.shutdown()
    # Fair share alone would be ~2x (4 runnable threads on 2 cores); 8x leaves room for a loaded host.
    assert busy < 8 * alone + 1.0, f"{busy:.2f} s beside two busy processes vs {alone:.2f} s without"
