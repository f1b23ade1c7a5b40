"""The simulated device (executor/simulated.py) and what overlaps with it.

- Exactness: with the fake device model every request's tokens are a fixed function of its
  tokens so far, so each output can be checked against that oracle, token for token, under
  preemption, chunked prefill, prefix caching, n > 1, stop tokens and max_tokens; and the
  two-micro-batch schedule (steps in flight on the device while the host schedules) gives the
  same tokens as the synchronous one, also with the real model.
- Overlap: with the core in its own process, or with async scheduling in one process, the front
  end's output processing of step N runs while the device runs step N+1: with device time D and
  front-end time H per step, a run takes about N * max(D, H), not N * (D + H) as with the core
  in-process and one step at a time (asserted with wide margins).
"""
from __future__ import annotations

import time

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.simulated import FakeDeviceModel, SimulatedDevice
from pagedllm.sampling_params import SamplingParams

VOCAB = 512  # tests/checkpoints.py's tiny models


def oracle(prompt: list[int], max_tokens: int, stop_ids=()) -> list[int]:
    model, toks, out = FakeDeviceModel(VOCAB), list(prompt), []
    for _ in range(max_tokens):
        t = model.next_token(toks)
        toks.append(t)
        out.append(t)
        if t in stop_ids:
            break
    return out


def run(engine: LLMEngine, requests) -> dict[str, list[list[int]]]:
    for rid, prompt, sp in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = [c.token_ids for c in out.outputs]
    return got


def workload():
    prompts = [[(7 * i + j) % VOCAB for j in range(5 + 3 * (i % 7))] for i in range(24)]
    shared = [(3 * j + 1) % VOCAB for j in range(40)]
    prompts += [shared + [1, 2, 3], shared + [4, 5], shared + [6]]  # prefix-cache hits on shared's blocks
    reqs = []
    for i, p in enumerate(prompts):
        n = 3 if i % 5 == 0 else 1
        sp = SamplingParams(temperature=0.0, max_tokens=6 + (i % 9) * 3, n=n, ignore_eos=True)
        if i % 4 == 1:  # a stop token the oracle meets at its 3rd token: no token after it
            sp = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[oracle(p, 3)[-1]], ignore_eos=True)
        reqs.append((f"r{i}", p, sp))
    return reqs


@pytest.mark.parametrize("batches", [1, 2, "async"])
def test_fake_device_outputs_match_the_oracle(llama_ckpt, batches):
    """A small cache (preemptions), a small token budget (chunked prefill), prefix caching; one
    step at a time, two micro-batches in flight, or async scheduling (the same requests' next
    step scheduled past the tokens in flight: stop tokens and max_tokens emit nothing extra)."""
    config = EngineConfig(model=llama_ckpt, max_model_len=128, max_num_batched_tokens=32, enable_chunked_prefill=True,
                          max_num_seqs=16, async_scheduling=batches == "async")
    engine = LLMEngine(config, skip_tokenizer_init=True,
                       executor_factory=SimulatedDevice(0.0, num_blocks=24,
                                                        max_concurrent_batches=1 if batches == "async" else batches))
    try:
        reqs = workload()
        got = run(engine, reqs)
        for rid, prompt, sp in reqs:
            want = oracle(prompt, sp.max_tokens, sp.stop_token_ids)
            assert got[rid] == [want] * sp.n, rid
        stats = engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the paths were exercised
        assert stats.num_free_blocks == stats.num_total_blocks
        engine.core.kv_cache_manager.pool.check_consistency()
    finally:
        engine.shutdown()


def test_two_batches_in_flight_match_the_synchronous_model(llama_ckpt):
    """The real model on the simulated device's thread, two micro-batches in flight: greedy
    tokens identical to the plain synchronous engine (chunked prefill, n > 1, prefix hits)."""
    kw = dict(model=llama_ckpt, dtype="float32", kv_cache_memory=4 << 20, max_model_len=128,
              max_num_batched_tokens=24, enable_chunked_prefill=True)
    reqs = [(f"q{i}", [(11 * i + j) % VOCAB for j in range(4 + 5 * (i % 4))],
             SamplingParams(temperature=0.0, max_tokens=8 + i, n=2 if i == 3 else 1, ignore_eos=True))
            for i in range(8)]
    results = []
    for factory, async_scheduling in ((None, False), (SimulatedDevice(0.0, real=True, max_concurrent_batches=2), False),
                                      (None, True)):
        engine = LLMEngine(EngineConfig(**kw, async_scheduling=async_scheduling), skip_tokenizer_init=True,
                           executor_factory=factory)
        try:
            results.append(run(engine, reqs))
            assert engine.core.batch_depth == (1 if factory is None and not async_scheduling else 2)
        finally:
            engine.shutdown()
    assert results[0] == results[1] == results[2]  # the last: async scheduling, the model on the step thread


def test_async_scheduling_goes_one_step_at_a_time_beside_a_beam_search(llama_ckpt):
    """A beam search (its next step depends on the tokens: beams fork) added while plain requests
    overlap: the steps in flight drain, the steps go one at a time while it runs; every output is
    the synchronous engine's."""
    from pagedllm.engine.beam_search import BeamSearchParams

    kw = dict(model=llama_ckpt, dtype="float32", kv_cache_memory=4 << 20, max_model_len=128)
    plain = [(f"g{i}", [(5 * i + j) % VOCAB for j in range(6 + i)],
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)) for i in range(3)]
    beam = [("b", [7, 8, 9, 10], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))]
    results = []
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(**kw, async_scheduling=async_scheduling), skip_tokenizer_init=True)
        try:
            for rid, prompt, sp in plain:
                engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
            for _ in range(3):  # the plain requests run (overlapped with async scheduling) before the beams join
                engine.step()
            results.append(run(engine, beam))
            stats = engine.get_stats()
            assert stats.num_free_blocks == stats.num_total_blocks
        finally:
            engine.shutdown()
    assert results[0] == results[1] and set(results[0]) == {"g0", "g1", "g2", "b"}


class _SlowOutputs:
    """Front-end output processing that takes ``seconds`` per step (a stand-in for detokenising
    and streaming a large batch)."""

    def __init__(self, engine: LLMEngine, seconds: float) -> None:
        self.inner, self.seconds = engine.output_processor.process_outputs, seconds
        engine.output_processor.process_outputs = self

    def __call__(self, outputs, step_start):
        if outputs:
            time.sleep(self.seconds)
        return self.inner(outputs, step_start)


def test_output_processing_overlaps_the_core_step(llama_ckpt):
    d = h = 0.04
    steps = 30
    reqs = [(f"s{i}", [i + 1, 2, 3], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
            for i in range(4)]
    took = {}
    for mp in (False, True, "async"):  # "async": in this process, with async scheduling
        config = EngineConfig(model=llama_ckpt, max_model_len=128, async_scheduling=mp == "async")
        engine = LLMEngine(config, skip_tokenizer_init=True, multiprocess=mp is True,
                           executor_factory=SimulatedDevice(d, num_blocks=256))
        try:
            _SlowOutputs(engine, h)
            t0 = time.perf_counter()
            got = run(engine, reqs)
            took[mp] = time.perf_counter() - t0
            assert all(got[rid] == [oracle(p, steps)] for rid, p, _ in reqs)
        finally:
            engine.shutdown()
    serial = steps * (d + h)
    assert took[False] >= 0.95 * serial  # in one process the two add up
    assert took[True] < 0.8 * serial, took  # about steps * max(d, h) with the core in its own process
    assert took["async"] < 0.8 * serial, took  # and in one process when the next step is scheduled ahead


def test_simulated_device_runs_queued_steps_back_to_back_on_its_own_clock():
    """Steps submitted together run back to back on the device's clock, as kernels queued on a
    GPU stream do: each starts when the previous one finished there, not when the device thread
    woke from its sleep, so the device is busy exactly N x D however late the thread wakes; and
    a step submitted while the device is idle starts at its submission (the idle gap is not
    charged to the device)."""
    from pagedllm.core.contracts import SchedulerOutput
    from pagedllm.executor.simulated import SimulatedDeviceExecutor

    d = 0.1
    ex = SimulatedDeviceExecutor(num_blocks=8, max_model_len=64, device_seconds=d)
    try:
        empty = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[], num_scheduled_tokens={},
                                total_num_scheduled_tokens=0, finished_req_ids=frozenset(),
                                preempted_req_ids=frozenset())
        t0 = time.perf_counter()
        for _ in range(3):
            ex.submit(empty)
        for _ in range(3):
            ex.collect()
        assert time.perf_counter() - t0 >= 3 * d
        assert ex.device_busy == pytest.approx(3 * d, rel=1e-6)
        time.sleep(d / 2)  # idle: not the device's time
        ex.execute(empty)
        assert ex.device_busy == pytest.approx(4 * d, rel=1e-6)
    finally:
        ex.shutdown()


def test_runner_mode_runs_the_real_runners_host_work_exactly(llama_ckpt):
    """``SimulatedDevice(runner=True)``: the real runner's diffs, input preparation and state
    update on the host thread, the forward and sampling simulated (the k-th output of a P-token
    prompt is ((P + k) * 7 + 3) % vocab): chunked prefill, n > 1, a stop token and max_tokens
    give exactly those tokens, one step at a time and with async scheduling."""
    kw = dict(model=llama_ckpt, dtype="float32", kv_cache_memory=4 << 20, max_model_len=128,
              max_num_batched_tokens=24, enable_chunked_prefill=True)
    prompts = [[(11 * i + j) % VOCAB for j in range(4 + 5 * (i % 4))] for i in range(6)]

    def token(p: int, k: int) -> int:
        return ((p + k) * 7 + 3) % VOCAB

    reqs = [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=9 + i, n=2 if i == 1 else 1, ignore_eos=True,
                                        stop_token_ids=[token(len(p), 4)] if i == 2 else None))
            for i, p in enumerate(prompts)]
    expected = {f"r{i}": [[token(len(p), k) for k in range(5 if i == 2 else 9 + i)]] * (2 if i == 1 else 1)
                for i, p in enumerate(prompts)}
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(**kw, async_scheduling=async_scheduling), skip_tokenizer_init=True,
                           executor_factory=SimulatedDevice(0.0, runner=True))
        try:
            assert run(engine, reqs) == expected
            stats = engine.get_stats()
            assert stats.num_free_blocks == stats.num_total_blocks
        finally:
            engine.shutdown()
