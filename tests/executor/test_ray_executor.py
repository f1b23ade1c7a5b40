"""The Ray executor on a local Ray cluster (started once for the module): TP=2 and PP=2 through Ray
actors give TP=1's greedy tokens; a worker actor killed mid-run fails the running request with an
error and the engine reports dead within 30 s (new requests are refused); no Ray, a clear error."""
import asyncio
import os
import sys
import time

import pytest

from prompts import random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")

SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts((5, 40, 130), seed=21)
KW = dict(dtype="float32", kv_cache_memory=8 << 20, max_model_len=512)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def greedy(llm, prompts=PROMPTS):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SP, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_ray_matches_one_rank(ray_cluster, make_ckpt, parallel):
    """Two ranks as Ray actors -- TP=2, or two pipeline stages (hidden states actor to actor over
    gloo, two steps in flight) -- give one rank's greedy tokens, also from the prefix cache."""
    path = make_ckpt("ray_llama", "llama", heads=4, kv_heads=2)
    one = LLM(model=path, **KW)
    try:
        want = greedy(one)
    finally:
        one.engine.shutdown()
    llm = LLM(model=path, distributed_executor_backend="ray", cpu_threads=1, **parallel, **KW)
    try:
        ex = llm.engine.core.executor
        assert type(ex).__name__ == "RayExecutor" and len(ex.actors) == 2
        assert greedy(llm) == want
        assert greedy(llm) == want  # again: from the prefix cache of both ranks
        assert len(ex.weight_bytes_per_rank) == 2 and ex.num_forward_tokens > 0
        stats = llm.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.prefix_cache_hits > 0
        if "pipeline_parallel_size" in parallel:  # each stage holds its own layers
            assert ex.weight_bytes_per_rank[0] < 0.75 * sum(ex.weight_bytes_per_rank)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_killed_worker_fails_requests_and_the_engine_fast(ray_cluster, make_ckpt, split):
    from pagedllm.engine.async_llm import AsyncLLM

    path = make_ckpt("ray_llama", "llama", heads=4, kv_heads=2)
    engine = AsyncLLM(EngineConfig(model=path, distributed_executor_backend="ray", cpu_threads=1, **split, **KW),
                      multiprocess=False)  # the test kills the executor's actors
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run() -> BaseException:
        got = 0
        try:
            async for out in engine.generate({"prompt_token_ids": PROMPTS[0]}, long, "long"):
                got += len(out.outputs[0].token_ids)
                if got >= 2 and got < 10:
                    ray.kill(engine.engine.core.executor.actors[1])
        except Exception as e:
            return e
        raise AssertionError(f"the request finished ({got} tokens) though a worker was killed")

    try:
        t0 = time.monotonic()
        error = asyncio.run(asyncio.wait_for(run(), 30))
        assert "engine" in str(error).lower() or "worker" in str(error).lower()
        while engine.is_running and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        assert not engine.is_running
        assert "rank 1" in repr(engine.dead_error)

        async def again():
            async for _ in engine.generate({"prompt_token_ids": PROMPTS[1]}, SP, "after"):
                pass

        with pytest.raises(Exception, match="engine has stopped"):  # DEAD_MESSAGE: no internals (issue 29)
            asyncio.run(again())
    finally:
        engine.shutdown()


def test_missing_ray_and_bad_settings_are_clear_errors(monkeypatch, make_ckpt):
    from pagedllm.executor.ray_executor import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match=r"pip install 'pagedllm\[ray\]'"):
        import_ray()
    path = make_ckpt("ray_llama", "llama", heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="distributed_executor_backend must be"):
        EngineConfig(model=path, distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="sums to 3"):  # before any actor starts
        LLM(model=path, pipeline_parallel_size=2, pp_layer_partition="1,2", distributed_executor_backend="ray", **KW)
    with pytest.raises(ValueError, match="Ray gives each worker its own GPU"):
        EngineConfig(model=path, distributed_executor_backend="ray", device="cuda:1")
    with pytest.raises(ValueError, match="cpu_threads_bind is for"):
        EngineConfig(model=path, distributed_executor_backend="ray", cpu_threads_bind="auto")
