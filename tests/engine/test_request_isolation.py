"""No code path run for one request takes the engine down (issue 29): a failure injected in one
request's output path -- the scheduler's update, beam bookkeeping, detokenization / stop strings,
building its RequestOutput, the metrics callback -- finishes that request with "error" (its
stream raises RequestFailedError, HTTP 500) while two others finish exactly as without it, every
KV block goes back, and the engine keeps serving. Beam requests with extreme length penalties
(the values that killed the engine, and more) run to the end."""
import asyncio

import pytest

from prompts import random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.core.beam_group import BeamGroup
from pagedllm.core.request_table import RequestTable
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.async_llm import AsyncLLM, RequestFailedError
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.output_processor import OutputProcessor

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CFG = dict(kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts((21, 9, 30), seed=11)


@pytest.fixture(scope="module")
def reference(llama_ckpt, prompts):
    outs = LLM(model=llama_ckpt, **CFG).generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _raise_on_nth(original, is_bad, nth: int):
    calls = {"n": 0}

    def wrapped(*args, **kw):
        if is_bad(*args, **kw):
            calls["n"] += 1
            if calls["n"] == nth:
                raise RuntimeError("injected failure")
        return original(*args, **kw)

    return wrapped


def inject(monkeypatch, where: str) -> None:
    """Make request "bad" raise once, at ``where``, after it has produced a few tokens."""
    if where == "scheduler_update":
        monkeypatch.setattr(Scheduler, "check_stop",
                            _raise_on_nth(Scheduler.check_stop, lambda self, req, tok: req.request_id.startswith("bad"), 3))
        # every row through its request's own path (the table clears rows that only append, unchecked)
        monkeypatch.setattr(RequestTable, "quiet_rows", lambda self, reqs, sampled: [False] * len(reqs))
    elif where == "output_processor":
        monkeypatch.setattr(OutputProcessor, "process",
                            _raise_on_nth(OutputProcessor.process, lambda self, out, now=None: out.req_id.startswith("bad"), 3))
    elif where == "completion":  # building its RequestOutput (cumulative outputs)
        monkeypatch.setattr(OutputProcessor, "completion",
                            _raise_on_nth(OutputProcessor.completion, lambda self, st, delta: st.request_id.startswith("bad"), 1))
    elif where == "detokenizer":
        from pagedllm.tokenizer.detokenizer import IncrementalDetokenizer

        monkeypatch.setattr(IncrementalDetokenizer, "step", _raise_on_nth(
            IncrementalDetokenizer.step, lambda self, ids: id(self) in POISONED, 2))


POISONED: set[int] = set()  # ids of the detokenizers that raise (the class has __slots__)


def run_engine(engine: LLMEngine, requests, poison_detok=False) -> dict:
    for name, p, params in requests:
        engine.add_request(name, {"prompt_token_ids": p}, params)
        if poison_detok and name == "bad":
            POISONED.update(id(st.detok) for rid, st in engine.output_processor.states.items() if rid.startswith("bad"))
    done = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert not engine.has_unfinished_requests()
    return done


def assert_clean(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0
    engine.core.kv_cache_manager.pool.check_consistency()
    op = engine.output_processor
    assert not op.states and not op.parents and not op.beams.requests


@pytest.mark.parametrize("where,n", [("scheduler_update", 1), ("scheduler_update", 2), ("output_processor", 2),
                                     ("completion", 1), ("completion", 2), ("detokenizer", 2)])
def test_a_failure_in_one_requests_output_path_fails_only_it(llama_ckpt, prompts, reference, monkeypatch, where, n):
    engine = LLMEngine(EngineConfig(model=llama_ckpt, **CFG))
    inject(monkeypatch, where)
    bad = GREEDY.clone(n=n)
    done = run_engine(engine, [("a", prompts[0], GREEDY), ("bad", prompts[1], bad), ("c", prompts[2], GREEDY)],
                      poison_detok=where == "detokenizer")
    assert [c.finish_reason for c in done["bad"].outputs] == ["error"] * n
    assert done["a"].outputs[0].token_ids == reference[0] and done["a"].outputs[0].finish_reason == "length"
    assert done["c"].outputs[0].token_ids == reference[2] and done["c"].outputs[0].finish_reason == "length"
    assert_clean(engine)
    # and it keeps serving
    again = run_engine(engine, [("d", prompts[1], GREEDY)])
    assert again["d"].outputs[0].token_ids == reference[1]
    assert_clean(engine)


def test_a_failure_in_one_beam_search_fails_only_it(llama_ckpt, prompts, reference, monkeypatch):
    engine = LLMEngine(EngineConfig(model=llama_ckpt, **CFG))
    monkeypatch.setattr(BeamGroup, "advance",
                        _raise_on_nth(BeamGroup.advance, lambda self, c, m: self.group_id == "bad", 2))
    beam = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    done = run_engine(engine, [("a", prompts[0], GREEDY), ("bad", prompts[1], beam), ("c", prompts[2], GREEDY)])
    assert [c.finish_reason for c in done["bad"].outputs] == ["error"]
    assert done["a"].outputs[0].token_ids == reference[0] and done["c"].outputs[0].token_ids == reference[2]
    assert_clean(engine)


def test_extreme_length_penalties_finish(llama_ckpt, prompts):
    engine = LLMEngine(EngineConfig(model=llama_ckpt, **CFG))
    reqs = []
    for i, lp in enumerate([1100.0, -2000.0, 1e308, -1e308, 5e-324]):
        for es in (False, "never"):
            reqs.append((f"b{i}{es}", prompts[i % 3], BeamSearchParams(beam_width=2 + i % 2, max_tokens=5,
                                                                       length_penalty=lp, early_stopping=es)))
    done = run_engine(engine, reqs)
    assert len(done) == len(reqs)
    for rid, out in done.items():
        assert out.outputs and all(c.finish_reason in ("stop", "length") for c in out.outputs), rid
    assert_clean(engine)


@pytest.mark.parametrize("lp", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_length_penalty_is_refused(lp):
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=lp)


def test_async_failures_never_kill_the_engine(llama_ckpt, prompts, reference, monkeypatch):
    """A stream whose output processing raises gets RequestFailedError; a metrics callback that
    raises for every request is logged; the other streams complete and the engine stays up."""
    inject(monkeypatch, "output_processor")

    async def scenario():
        llm = AsyncLLM(EngineConfig(model=llama_ckpt, **CFG))

        def broken_callback(out):
            raise ValueError("metrics callback broke")

        llm.on_finished = broken_callback
        try:
            async def collect(rid, p):
                last = None
                async for out in llm.generate({"prompt_token_ids": p}, GREEDY, request_id=rid):
                    last = out
                return last

            results = await asyncio.gather(collect("a", prompts[0]), collect("bad", prompts[1]),
                                           collect("c", prompts[2]), return_exceptions=True)
            assert isinstance(results[1], RequestFailedError)
            assert results[0].outputs[0].finish_reason == "length" and results[2].outputs[0].finish_reason == "length"
            assert llm.is_running
            last = await collect("d", prompts[1])
            assert last.finished and llm.num_unfinished() == 0
        finally:
            llm.shutdown()

    asyncio.run(scenario())


def test_a_large_n_request_leaves_slots_for_others(llama_ckpt, prompts):
    """max_num_seqs 8, a quarter of it per request (the server's default share): a request of n=8
    runs 2 sequences at a time, and a short request sent after it is admitted beside them and
    finishes long before it."""
    engine = LLMEngine(EngineConfig(model=llama_ckpt, max_num_seqs=8, max_num_seqs_per_request=2, **CFG))
    big = SamplingParams(temperature=0.8, seed=3, n=8, max_tokens=40, ignore_eos=True)
    engine.add_request("big", {"prompt_token_ids": prompts[0]}, big)
    engine.step()
    engine.add_request("short", {"prompt_token_ids": prompts[1]}, SamplingParams(temperature=0, max_tokens=2))
    finished_first = None
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        assert engine.get_stats().num_running <= 2 + 1
        for o in engine.step():
            if o.finished and finished_first is None:
                finished_first = o.request_id
    assert finished_first == "short"
    assert_clean(engine)
    engine.shutdown()
