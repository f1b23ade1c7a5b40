"""The CPU KV cache's idle prefault (worker/cpu_memory.IdlePrefault) runs in the engine's idle
loop: a server engine left alone faults its cache's first blocks in, slice by slice, and a request
arriving meanwhile gets the same tokens as with the prefault off."""
from __future__ import annotations

import asyncio
import time

from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def _generate(engine, prompt):
    async def run():
        last = None
        async for out in engine.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12,
                                                                                     ignore_eos=True)):
            last = out
        return last

    return asyncio.run(asyncio.wait_for(run(), 60))


def test_idle_engine_prefaults_its_cache_and_outputs_do_not_change(llama_ckpt):
    outs = []
    for idle_bytes in (0, 32 << 20):
        config = EngineConfig(model=llama_ckpt, max_model_len=256, kv_cache_memory=64 << 20, dtype="float32",
                              cpu_kv_cache_idle_prefault=idle_bytes)
        engine = AsyncLLM(config, LLMEngine(config))
        try:
            pre = engine.engine.core.executor.worker.kv_idle_prefault
            if idle_bytes == 0:
                assert pre is None
            else:
                outs_first = _generate(engine, [1, 2, 3, 4])  # while it may still be prefaulting
                t0 = time.monotonic()
                while not pre.done:
                    assert time.monotonic() - t0 < 30, "the idle loop did not prefault"
                    time.sleep(0.05)
                assert 0 < pre.populated_bytes <= (32 << 20) + (4 << 20) or pre.populated_bytes == 0  # 0: no MADV_POPULATE_WRITE
                assert outs_first.outputs[0].token_ids == _generate(engine, [1, 2, 3, 4]).outputs[0].token_ids
            outs.append(_generate(engine, [5, 6, 7]).outputs[0].token_ids)
        finally:
            engine.shutdown()
    assert outs[0] == outs[1]
