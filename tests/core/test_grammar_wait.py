"""Constrained requests as a scheduler status: WAITING_FOR_GRAMMAR in the queue while the grammar
compiles, the step's bitmask in SchedulerOutput.grammar, the grammar's verdicts applied by the
unit -- with a model-free grammar source (the real one is engine/structured_outputs.py)."""
import pytest

from pagedllm.core.contracts import GrammarBitmask, ModelRunnerOutput
from pagedllm.core.grammar_wait import Advance
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from scheduler_steps import fake_step


class FakeGrammars:
    """Compiles finish when the test says; a grammar allows token 7 only and ends after ``length``."""

    def __init__(self, length=3):
        self.length = length
        self.compiling: dict[str, str] = {}  # id -> "pending" | "done" | "failed"
        self.accepted: dict[str, int] = {}
        self.masks_asked: list[list[str]] = []
        self.waits = 0

    @property
    def num_compiling(self):
        return len(self.compiling)

    def submit(self, request):
        self.compiling[request.request_id] = "pending"

    def ready(self, request):
        state = self.compiling[request.request_id]
        if state == "pending":
            return False
        del self.compiling[request.request_id]
        if state == "failed":
            raise ValueError("structured_outputs.regex: the regular expression could not be compiled")
        self.accepted[request.request_id] = 0
        return True

    def wait(self, timeout):
        self.waits += 1

    def bitmask(self, req_ids):
        ids = [r for r in req_ids if r in self.accepted]
        self.masks_asked.append(ids)
        return GrammarBitmask({r: i for i, r in enumerate(ids)}, [[1 << 7]] * len(ids)) if ids else None

    def accept(self, req_id, tokens, stop_token_ids):
        for t in tokens:
            if t != 7:
                return Advance(rejected=True, terminated=False)
            self.accepted[req_id] += 1
        return Advance(False, self.accepted[req_id] >= self.length)

    def remove(self, req_id):
        self.compiling.pop(req_id, None)
        self.accepted.pop(req_id, None)


def make(grammars, budget=32):
    return Scheduler(SchedulerLimits(8, budget, 256), KVCacheManager(64, 4, True), grammars=grammars)


def add(s, rid, n_prompt, constrained, max_tokens=8):
    so = StructuredOutputsParams(regex="7+") if constrained else None
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_outputs=so)
    s.add_request(Request(rid, list(range(1, n_prompt + 1)), sp, max_tokens=max_tokens))


def drain(s, steps=50, sampled=7):
    finished = {}
    for _ in range(steps):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        ids = list(so.num_scheduled_tokens)
        toks = [[sampled] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        for o in s.update_from_output(so, ModelRunnerOutput(ids, toks)) + s.take_failed():
            if o.finish_reason:
                finished[o.req_id] = o.finish_reason
    return finished


def test_compiling_request_waits_in_the_queue_while_others_run_then_runs_masked():
    g = FakeGrammars(length=3)
    s = make(g, budget=6)
    add(s, "g", 10, constrained=True)
    add(s, "p", 3, constrained=False)
    assert s.requests["g"].status == RequestStatus.WAITING_FOR_GRAMMAR
    so, _ = fake_step(s)
    assert list(so.num_scheduled_tokens) == ["p"] and so.grammar is None  # set aside, the plain one goes on
    assert s.get_stats().num_waiting == 1 and s.waiting[0].request_id == "g"
    g.compiling["g"] = "done"
    so, _ = fake_step(s)  # admitted: a first prefill chunk of 5 (p decodes): it does not sample yet
    assert so.num_scheduled_tokens == {"p": 1, "g": 5} and so.grammar is None
    so, outs = fake_step(s)  # the last chunk samples: its mask goes with the step
    assert so.num_scheduled_tokens["g"] == 5 and so.grammar.rows == {"g": 0}
    assert [o.new_token_ids for o in outs if o.req_id == "g"] == [[7]]
    assert drain(s) == {"g": "stop", "p": "length"}  # the grammar's end stopped it after 3 tokens
    assert g.accepted == {} and g.compiling == {}
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_failed_compile_is_an_error_output_and_leaves_nothing_behind():
    g = FakeGrammars()
    s = make(g)
    add(s, "bad", 4, constrained=True)
    add(s, "ok", 4, constrained=False)
    g.compiling["bad"] = "failed"
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["ok"]  # the one behind the failed one is admitted
    assert [(o.req_id, o.finish_reason) for o in s.take_failed()] == [("bad", "error")]
    assert s.take_failed() == [] and "bad" not in s.requests and [r.request_id for r in s.waiting] == []


def test_abort_while_compiling_withdraws_the_compile():
    g = FakeGrammars()
    s = make(g)
    add(s, "g", 4, constrained=True)
    assert s.finish_requests(["g"], RequestStatus.FINISHED_ABORTED) == ["g"]
    assert g.compiling == {} and not s.has_unfinished_requests()


def test_a_token_the_grammar_forbids_fails_the_request():
    g = FakeGrammars()
    s = make(g)
    add(s, "g", 4, constrained=True)
    g.compiling["g"] = "done"
    assert drain(s, sampled=3) == {"g": "error"}
    assert g.accepted == {} and s.kv.num_free_blocks == s.kv.num_total_blocks


def test_idle_scheduler_waits_for_a_compile_and_refuses_without_a_source():
    g = FakeGrammars()
    s = make(g)
    add(s, "g", 4, constrained=True)
    so = s.schedule()
    assert so.is_empty and g.waits == 1  # nothing else to run: it waited for the compile
    add(s, "p", 4, constrained=False)
    s.schedule()
    assert g.waits == 1  # a plain request could run: no wait
    with pytest.raises(ValueError, match="structured_outputs needs the engine's tokenizer"):
        add(make(None), "g", 4, constrained=True)
