"""The engine core in its own process (engine/core_client.MultiprocClient): the same outputs as
in one process (n > 1, best_of, beam search, stop strings, logprobs); calls (stats, prefix
cache reset, forward-token counts); start-up errors raised in the caller; a killed core ends
every open stream with EngineDeadError within a second and never hangs; shutdown leaves no
process behind."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from processes import alive

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

KW = dict(dtype="float32", kv_cache_memory=16 << 20, max_model_len=256)


def _outputs(llm: LLM):
    sp = [SamplingParams(temperature=0, max_tokens=10, n=2, logprobs=2),
          SamplingParams(temperature=0.8, seed=5, max_tokens=8, n=2, best_of=3),
          SamplingParams(temperature=0, max_tokens=20, stop=["w3"], ignore_eos=True)]
    outs = llm.generate(["w1 w2 w3", "w4 w5", "w1 w2"], sp, use_tqdm=False)
    got = [[(c.token_ids, c.text, c.finish_reason, c.cumulative_logprob) for c in o.outputs] for o in outs]
    beams = llm.beam_search("w1 w2", BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    got.append([(s.tokens, s.cum_logprob) for s in beams[0].sequences])
    return got


def test_core_process_gives_the_in_process_outputs(llama_ckpt):
    results = []
    for mp in (False, True):
        llm = LLM(llama_ckpt, engine_core_process=mp, **KW)
        try:
            results.append(_outputs(llm))
            assert llm.engine.num_forward_tokens > 0
            assert llm.reset_prefix_cache() is True
            assert llm.get_stats().num_free_blocks == llm.get_stats().num_total_blocks
            if mp:
                pid = llm.engine.client.pid
                with pytest.raises(AttributeError):
                    llm.engine.core  # noqa: B018 - the core lives elsewhere
        finally:
            llm.engine.shutdown()
    assert results[0] == results[1]
    assert not alive(pid), "the core process outlived shutdown"


def test_core_process_start_up_error_is_raised_here(tmp_path, llama_ckpt):
    with pytest.raises(ValueError, match="kv_cache_memory|KV cache|blocks"):
        LLM(llama_ckpt, engine_core_process=True, dtype="float32", kv_cache_memory=1, max_model_len=256)


def test_killed_core_process_ends_streams_within_a_second(llama_ckpt):
    from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.executor.simulated import SimulatedDevice

    config = EngineConfig(model=llama_ckpt, max_model_len=256)
    # 20 ms a step: the request is still running when the core is killed
    engine = AsyncLLM(config, LLMEngine(config, multiprocess=True, executor_factory=SimulatedDevice(0.02)))
    try:
        pid = engine.engine.client.pid

        async def scenario():
            sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            gen = engine.generate({"prompt_token_ids": [1, 2, 3]}, sp, "doomed")
            first = await gen.__anext__()
            assert not first.finished
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
            return time.monotonic() - t0

        took = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert took < 1.0, took
        assert not engine.is_running and engine.dead_error is not None

        async def after():
            with pytest.raises(EngineDeadError):
                await engine.generate({"prompt_token_ids": [1]}, SamplingParams(max_tokens=2)).__anext__()

        asyncio.run(after())
    finally:
        t0 = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - t0 < 10  # nothing hangs on a dead core


def test_step_outputs_cross_the_pipe_unchanged():
    """EngineCoreOutputs pickle with their outputs as one msgpack buffer: every field comes back
    equal, -inf logprobs, int and str stop reasons and beam hypotheses included."""
    import math
    import pickle

    from pagedllm.core.contracts import BeamHypothesis, EngineCoreOutput, Logprobs
    from pagedllm.core.engine_request import EngineCoreOutputs, StepTiming

    lp = Logprobs([[5, 9], [7, 1]], [[-0.25, -math.inf], [-1e-9, -3.5]], [1, 4], 2)
    outs = EngineCoreOutputs([
        EngineCoreOutput("a-0", [5, 7], "stop", "w3", lp, lp, 16, None, 1),
        EngineCoreOutput("b", [], "length", 2, None, None, 0, [BeamHypothesis([5], -0.25, -0.2, [lp], "stop", 7)], 0),
        EngineCoreOutput("c", [2 ** 40], None, None, None, None, 0, None, 0),
    ], None, StepTiming(0.1, 0.2, 0.3, 0.6))
    back = pickle.loads(pickle.dumps(outs, protocol=5))
    assert back == outs
    assert type(back.outputs[1].beam_hypotheses[0]) is BeamHypothesis and back.outputs[0].logprobs.start == 2
