"""A deadline travels with the request into the core (EngineCoreRequest.deadline) and the core ends
the request there, with nobody aborting it: in this process and in the core's own process, for n > 1
children, a beam search and an AsyncLLM stream; every KV block comes back."""
from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.simulated import SimulatedDevice
from pagedllm.sampling_params import SamplingParams

PROMPT = {"prompt_token_ids": [1, 2, 3, 4, 5]}


def _run_until_done(engine, limit_s=30.0):
    finals = {}
    t0 = time.monotonic()
    while engine.has_unfinished_requests():
        assert time.monotonic() - t0 < limit_s, "the engine did not end its requests"
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "core-process"])
def test_core_ends_requests_at_their_deadline(llama_ckpt, multiprocess):
    config = EngineConfig(model=llama_ckpt, max_model_len=256, kv_cache_memory=16 << 20)
    # the real model, at least 10 ms a step: 200 tokens take 2 s, far past a 0.3 s deadline
    engine = LLMEngine(config, multiprocess=multiprocess, executor_factory=SimulatedDevice(0.01, real=True))
    try:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        soon = time.monotonic() + 0.3
        engine.add_request("timed", PROMPT, long, deadline=soon)
        engine.add_request("pair", PROMPT, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, n=2),
                           deadline=soon)
        engine.add_request("beams", PROMPT, BeamSearchParams(beam_width=2, max_tokens=200, ignore_eos=True),
                           deadline=soon)
        engine.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        finals = _run_until_done(engine)
        took = time.monotonic() - soon
        assert set(finals) == {"timed", "pair", "beams", "free"}
        for rid in ("timed", "pair", "beams"):
            reasons = {c.finish_reason for c in finals[rid].outputs}
            assert reasons == {"abort"}, (rid, reasons)
            assert all(len(c.token_ids) < 200 for c in finals[rid].outputs)
        assert len(finals["pair"].outputs) == 2
        assert [c.finish_reason for c in finals["free"].outputs] == ["length"]
        assert len(finals["free"].outputs[0].token_ids) == 40
        assert took < 5.0
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.shutdown()


def test_async_stream_ends_at_the_deadline_without_an_abort(llama_ckpt):
    from pagedllm.engine.async_llm import AsyncLLM

    config = EngineConfig(model=llama_ckpt, max_model_len=256, kv_cache_memory=16 << 20)
    engine = AsyncLLM(config, LLMEngine(config, multiprocess=True, executor_factory=SimulatedDevice(0.01)))
    aborted = []
    engine.abort = aborted.append  # the front end never aborts: only the core can end it

    async def scenario():
        sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        last = None
        async for out in engine.generate(PROMPT, sp, "timed", deadline=time.monotonic() + 0.3):
            last = out
        return last

    try:
        last = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert aborted == []
        t0 = time.monotonic()
        while engine.stats.num_free_blocks != engine.stats.num_total_blocks:
            assert time.monotonic() - t0 < 5
            time.sleep(0.05)
    finally:
        engine.shutdown()
