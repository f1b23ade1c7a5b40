"""A step that raises fails only the requests it scheduled ("error"), never the engine: later
requests run normally, no block leaks, and blocks the failed step registered in the prefix cache
(possibly never written) are not reused. Through AsyncLLM the failed stream raises
RequestFailedError (HTTP 500 in the server) while the engine keeps running."""
import asyncio

import pytest

from prompts import random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM, RequestFailedError
from pagedllm.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def break_second_layer(engine: LLMEngine, failures: list) -> None:
    """Layer 1 raises while ``failures`` is non-empty: layer 0 has already written part of the
    step's K/V, so the failed step leaves half-written blocks behind."""
    layer = engine.core.executor.worker.model.model.layers[1]
    forward = layer.forward

    def flaky(*args, **kw):
        if failures:
            failures.pop()
            raise RuntimeError("injected failure")
        return forward(*args, **kw)

    layer.forward = flaky


def test_failed_step_fails_its_requests_only_and_uncaches_their_blocks(llama_ckpt):
    prompts = random_prompts((40, 23), seed=5)  # 40 tokens = 2 full blocks of 16 to be hashed
    reference = LLM(model=llama_ckpt, kv_cache_memory=16 << 20).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)

    engine = LLMEngine(EngineConfig(model=llama_ckpt, kv_cache_memory=16 << 20))
    failures = ["once"]
    break_second_layer(engine, failures)
    engine.add_request("bad", {"prompt_token_ids": prompts[0]}, GREEDY)
    outs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [("bad", True, "error")]
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not engine.has_unfinished_requests()

    # The same prompt again must not hit the failed step's half-written blocks.
    engine.add_request("again", {"prompt_token_ids": prompts[0]}, GREEDY)
    engine.add_request("other", {"prompt_token_ids": prompts[1]}, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert done["again"].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert done["other"].outputs[0].token_ids == reference[1].outputs[0].token_ids
    assert done["again"].outputs[0].finish_reason == "length"
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    engine.core.kv_cache_manager.pool.check_consistency()


def test_async_scheduling_recovers_from_a_failed_step_in_flight(llama_ckpt):
    """Async scheduling: a step fails while the next one (scheduled past its tokens) is in flight;
    that one is redone, the failed one isolated: the same greedy tokens as an engine that never
    failed, no block leaked."""
    prompts = random_prompts((12, 20, 7), seed=7)
    reference = LLM(model=llama_ckpt, kv_cache_memory=16 << 20).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    engine = LLMEngine(EngineConfig(model=llama_ckpt, kv_cache_memory=16 << 20, async_scheduling=True))
    try:
        failures: list = []
        break_second_layer(engine, failures)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
        done, calls = {}, 0
        while engine.has_unfinished_requests():
            calls += 1
            if calls == 3:
                failures.append("once")  # a decode step, with the next one submitted behind it
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        assert not failures  # the failure happened
        assert [done[f"r{i}"].outputs[0].token_ids for i in range(3)] == [r.outputs[0].token_ids for r in reference]
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        engine.core.kv_cache_manager.pool.check_consistency()
    finally:
        engine.shutdown()


def test_async_stream_raises_and_engine_keeps_serving(llama_ckpt):
    async def scenario():
        llm = AsyncLLM(EngineConfig(model=llama_ckpt, kv_cache_memory=16 << 20), multiprocess=False)  # layer patched
        failures = ["once"]
        break_second_layer(llm.engine, failures)
        try:
            with pytest.raises(RequestFailedError, match="failed inside the engine"):
                async for _ in llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, request_id="bad"):
                    pass
            assert llm.is_running
            last = None
            async for out in llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, request_id="good"):
                last = out
            assert last.finished and last.outputs[0].finish_reason == "length"
            assert llm.num_unfinished() == 0
        finally:
            llm.shutdown()

    asyncio.run(scenario())


def test_server_maps_a_failed_request_to_http_500():
    from pagedllm.entrypoints.openai.serving import to_api_error

    err = to_api_error(RequestFailedError("request bad failed inside the engine"))
    assert err.status == 500 and err.code == "request_failed" and "failed inside the engine" in err.message


def poison_executor(engine: LLMEngine, poison: str, after_execute: bool = True) -> list:
    """Every step that schedules ``poison`` raises -- after the worker ran it (its K/V written,
    its states advanced), the hardest case to undo. Returns the list of steps' request ids."""
    executor = engine.core.executor
    execute, seen = executor.execute, []

    def flaky(so):
        seen.append(sorted(so.num_scheduled_tokens))
        if not after_execute and poison in so.num_scheduled_tokens:
            raise RuntimeError("injected failure")
        out = execute(so)
        if poison in so.num_scheduled_tokens:
            raise RuntimeError("injected failure")
        return out

    executor.execute = flaky
    return seen


@pytest.mark.parametrize("after_execute", [True, False])
def test_failed_step_errors_only_the_request_that_caused_it(llama_ckpt, after_execute):
    prompts = random_prompts((40, 23, 17, 33, 9), seed=7)
    reference = LLM(model=llama_ckpt, kv_cache_memory=16 << 20).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    engine = LLMEngine(EngineConfig(model=llama_ckpt, kv_cache_memory=16 << 20))
    names = ["a", "b", "bad", "c", "d"]
    steps = poison_executor(engine, "bad", after_execute)
    for name, p in zip(names, prompts):
        engine.add_request(name, {"prompt_token_ids": p}, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert done["bad"].outputs[0].finish_reason == "error" and not done["bad"].outputs[0].token_ids
    for i, name in enumerate(names):
        if name != "bad":
            assert done[name].outputs[0].finish_reason == "length"
            assert done[name].outputs[0].token_ids == reference[i].outputs[0].token_ids, name
    # One failed batch of 5, then halves: [a, b] runs, [bad, c, d] fails, [bad] fails, [c, d] runs.
    assert steps[:5] == [["a", "b", "bad", "c", "d"], ["a", "b"], ["bad", "c", "d"], ["bad"], ["c", "d"]]
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0
    engine.core.kv_cache_manager.pool.check_consistency()
