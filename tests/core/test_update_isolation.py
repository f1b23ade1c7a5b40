"""No code path run for one request takes the scheduler down (issue 29): beam scores are compared in
log space, so no length_penalty (+-1e308, 1100, -2000, subnormal) overflows or divides by zero,
and the order is the exact order of ``cum / len ** penalty`` wherever that is computable; a
failure while applying one request's (or one beam group's) step output finishes that request
with "error" and frees its blocks, while the others finish as they would have."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.core.beam_group import BeamGroup, score_key, score_of_key
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request_table import RequestTable
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams
from test_beam_blocks import EOS, PROMPTS, FakeRunner, run

EXTREME = [1100.0, -2000.0, 1e308, -1e308, 5e-324, -5e-324, 1e-300, 0.0, 1.0, 709.0, -745.0]
penalties = st.one_of(st.sampled_from(EXTREME), st.floats(allow_nan=False, allow_infinity=False))
cums = st.one_of(st.just(0.0), st.just(-math.inf), st.floats(max_value=0.0, allow_nan=False))


def direct(cum: float, length: int, p: float):
    """HF's score, or None where floats cannot hold it (overflow, division by zero, 0 or inf)."""
    try:
        s = cum / (length ** p)
    except (OverflowError, ZeroDivisionError):
        return None
    return s if math.isfinite(s) and s != 0.0 else None


@settings(max_examples=400, deadline=None)
@given(a=cums, b=cums, la=st.integers(1, 100_000), lb=st.integers(1, 100_000), p=penalties)
def test_score_key_never_raises_and_orders_as_the_direct_score(a, b, la, lb, p):
    ka, kb = score_key(a, la, p), score_key(b, lb, p)
    assert not math.isnan(ka) and not math.isnan(kb)
    assert not math.isnan(score_of_key(ka))
    da, db = direct(a, la, p), direct(b, lb, p)
    if da is not None and db is not None and abs(da - db) > 1e-9 * max(abs(da), abs(db)):
        assert (ka > kb) == (da > db), (a, la, b, lb, p)
    if da is not None and abs(da) > 1e-300:
        assert score_of_key(ka) == pytest.approx(da, rel=1e-9)


def test_score_key_edges():
    assert score_key(0.0, 7, 1e308) == math.inf and score_of_key(math.inf) == 0.0  # 0 is the best score
    assert score_key(-math.inf, 5, 1e308) == -math.inf and score_of_key(-math.inf) == -math.inf
    assert score_key(-2.0, 1, 1e308) == -math.log(2.0)  # length 1: no penalty at all
    assert score_of_key(-1e6) == -math.inf and score_of_key(1e6) == -0.0


@pytest.mark.parametrize("lp", [1100.0, -2000.0, 1e308, -1e308, 5e-324])
@pytest.mark.parametrize("es", [False, True, "never"])
def test_extreme_length_penalties_run_to_the_end_without_leaks(lp, es):
    groups = [(PROMPTS[0], 4, lp, es), (PROMPTS[1], 2, lp, es)]
    results, _, _, _ = run(groups, plain=1)  # run() asserts: no leaked block, nothing left behind
    assert set(results) == {"g0", "g1"}
    for gid, hyps in results.items():
        assert hyps and all(h[2] in ("stop", "length") for h in hyps), gid
        scores = [h[1] for h in hyps]
        assert scores == sorted(scores, reverse=True) and not any(math.isnan(x) for x in scores)


def _scheduler(num_blocks=64):
    kv = KVCacheManager(num_blocks, 4, True)
    return kv, Scheduler(SchedulerLimits(16, 64, 512), kv)


def _drive(s, runner, limit=200):
    finals = {}
    for _ in range(limit):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        for o in s.update_from_output(so, runner.step(so)):
            if o.finish_reason is not None:
                finals[o.req_id] = o
    return finals


def test_one_request_raising_in_the_update_fails_only_it(monkeypatch):
    kv, s = _scheduler()
    for name in ("a", "bad", "c"):
        s.add_request(Request(name, [9, 8, 7, 6, 5], SamplingParams(max_tokens=6, ignore_eos=True), max_tokens=6))
    check = Scheduler.check_stop
    calls = {"n": 0}

    def flaky(self, req, tok):
        if req.request_id == "bad":
            calls["n"] += 1
            if calls["n"] == 3:  # after it has generated tokens and holds blocks
                raise RuntimeError("injected failure")
        return check(self, req, tok)

    monkeypatch.setattr(Scheduler, "check_stop", flaky)
    # every row through its request's own path (the table clears rows that only append, unchecked)
    monkeypatch.setattr(RequestTable, "quiet_rows", lambda self, reqs, sampled: [False] * len(reqs))
    finals = _drive(s, FakeRunner(64, 4))
    assert finals["bad"].finish_reason == "error"
    assert finals["a"].finish_reason == finals["c"].finish_reason == "length"
    assert kv.num_free_blocks == kv.num_total_blocks and not s.requests and not s.running
    kv.pool.check_consistency()


@pytest.mark.parametrize("where", ["advance", "fork"])
def test_one_beam_group_raising_fails_only_it(monkeypatch, where):
    kv, s = _scheduler(128)
    for gid, prompt in (("g0", PROMPTS[0]), ("bad", PROMPTS[2])):
        req = Request(gid, prompt, SamplingParams(max_tokens=9, temperature=0.0).with_eos([EOS]), max_tokens=9)
        req.beam = BeamGroup(gid, 3, 1.0, False)
        s.add_request(req)
    s.add_request(Request("p", [9] * 5, SamplingParams(max_tokens=6, ignore_eos=True), max_tokens=6))
    steps = {"n": 0}
    if where == "advance":
        advance = BeamGroup.advance

        def flaky(self, cands, max_model_len):
            if self.group_id == "bad":
                steps["n"] += 1
                if steps["n"] == 3:
                    raise ZeroDivisionError("injected")
            return advance(self, cands, max_model_len)

        monkeypatch.setattr(BeamGroup, "advance", flaky)
    else:  # after some children forked their parent's blocks: those references must go back too
        from pagedllm.core import beam_scheduling

        child = beam_scheduling._child

        def flaky_child(sched, group, parent, token):
            if group.group_id == "bad":
                steps["n"] += 1
                if steps["n"] == 5:
                    raise OverflowError("injected")
            return child(sched, group, parent, token)

        monkeypatch.setattr(beam_scheduling, "_child", flaky_child)
    finals = _drive(s, FakeRunner(128, 4))
    assert finals["bad"].finish_reason == "error" and finals["bad"].beam_hypotheses == []
    assert finals["g0"].finish_reason in ("stop", "length") and finals["g0"].beam_hypotheses
    assert finals["p"].finish_reason == "length"
    assert kv.num_free_blocks == kv.num_total_blocks and not s.requests and not s.beam_groups
    kv.pool.check_consistency()


def _drive_collecting_failures(s, runner, limit=200):
    """_drive, plus the units that raised while scheduled (Scheduler.take_failed, as EngineCore.step)."""
    finals, scheduled = {}, []
    for _ in range(limit):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        scheduled.append(set(so.num_scheduled_tokens))
        for o in s.take_failed() + s.update_from_output(so, runner.step(so)):
            if o.finish_reason is not None:
                finals[o.req_id] = o
    return finals, scheduled


@pytest.mark.parametrize("where,call", [("get_computed_blocks", 1), ("send", 1), ("send", 3)])
def test_one_request_raising_while_scheduled_fails_only_it(monkeypatch, where, call):
    """Issue 29: a raise in one request's scheduling -- before it holds anything (the prefix
    lookup), after its blocks are allocated at admission (send 1), or while it decodes after its
    tokens were taken from the budget (send 3) -- finishes it with "error", takes it out of that
    step and frees its blocks; the others run to the end."""
    kv, s = _scheduler()
    for name in ("a", "bad", "c"):
        s.add_request(Request(name, [9, 8, 7, 6, 5], SamplingParams(max_tokens=6, ignore_eos=True), max_tokens=6))
    target = kv if where == "get_computed_blocks" else Scheduler
    original = getattr(target, where)
    calls = {"n": 0}

    def flaky(*args):
        req = next(a for a in args if isinstance(a, Request))
        if req.request_id == "bad":
            calls["n"] += 1
            if calls["n"] == call:
                raise RuntimeError("injected scheduling failure")
        return original(*args)

    monkeypatch.setattr(target, where, flaky)
    # every row through its unit (the table's plain decode rows are taken in bulk, without send)
    monkeypatch.setattr(RequestTable, "decode_rows", lambda self, running, room: [False] * len(running))
    finals, scheduled = _drive_collecting_failures(s, FakeRunner(64, 4))
    assert finals["bad"].finish_reason == "error"
    assert finals["a"].finish_reason == finals["c"].finish_reason == "length"
    # in the steps before the failing call only: the failing step and every later one run without it
    assert [k for k, ids in enumerate(scheduled) if "bad" in ids] == list(range(call - 1 if where == "send" else 0))
    assert kv.num_free_blocks == kv.num_total_blocks and not s.requests and not s.running and not s.waiting
    kv.pool.check_consistency()


def test_a_beam_group_raising_while_scheduled_fails_only_it(monkeypatch):
    kv, s = _scheduler(128)
    for gid, prompt in (("g0", PROMPTS[0]), ("bad", PROMPTS[2])):
        req = Request(gid, prompt, SamplingParams(max_tokens=9, temperature=0.0).with_eos([EOS]), max_tokens=9)
        req.beam = BeamGroup(gid, 3, 1.0, False)
        s.add_request(req)
    s.add_request(Request("p", [9] * 5, SamplingParams(max_tokens=6, ignore_eos=True), max_tokens=6))
    from pagedllm.core.beam_scheduling import BeamUnit

    original, steps = BeamUnit._send, {"n": 0}

    def flaky(self, sched, plan, beams, tokens):
        original(self, sched, plan, beams, tokens)  # its beams' tokens are in the plan, their blocks allocated
        if self.unit_id == "bad":
            steps["n"] += 1
            if steps["n"] == 3:  # its beams have forked and hold shared blocks
                raise RuntimeError("injected")

    monkeypatch.setattr(BeamUnit, "_send", flaky)
    finals, _ = _drive_collecting_failures(s, FakeRunner(128, 4))
    assert finals["bad"].finish_reason == "error" and finals["bad"].beam_hypotheses == []
    assert finals["g0"].beam_hypotheses and finals["p"].finish_reason == "length"
    assert kv.num_free_blocks == kv.num_total_blocks and not s.requests and not s.beam_groups
    kv.pool.check_consistency()
