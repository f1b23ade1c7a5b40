"""The request table's columns (core/request_table.py) against each request's own path: the rows
it clears in bulk (decode rows, output rows that only append) are exactly the ones whose per-request
handling would change nothing else; slots are reused; out-of-range and very many stop ids fall back
to the request's own path instead of failing."""
from pagedllm.core.contracts import ModelRunnerOutput
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.request_table import MAX_STOP_COLUMNS, RequestTable
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams


def _params():
    return [
        SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=[10**30]),  # matches no token
        SamplingParams(max_tokens=30, ignore_eos=True, min_tokens=2, stop_token_ids=list(range(7, 7 + 3 * 64, 3))),
        SamplingParams(max_tokens=30, ignore_eos=True, min_tokens=3, stop_token_ids=[13, 21]),
        SamplingParams(max_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=10**30, ignore_eos=True, min_tokens=10**29, stop_token_ids=[0, 5]),  # never stops early
    ]


def _run(bulk: bool, monkeypatch):
    if not bulk:
        monkeypatch.setattr(RequestTable, "quiet_rows", lambda self, reqs, sampled: [False] * len(reqs))
        monkeypatch.setattr(RequestTable, "decode_rows", lambda self, running, room: [0] * len(running))
    s = Scheduler(SchedulerLimits(4, 64, 64), KVCacheManager(40, 4, True))
    for k in range(3):  # more requests than slots at first: the table grows and reuses rows
        for i, sp in enumerate(_params()):
            s.add_request(Request(f"r{k}.{i}", [1 + i, 2, 3, 4, 5 + k], sp, max_tokens=min(sp.max_tokens, 40)))
    outs, step = {}, 0
    while s.has_unfinished_requests():
        so = s.schedule()
        ids = list(so.num_scheduled_tokens)
        sampled = [[(7 * step + 3 * len(r)) % 50] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens
                   else [] for r in ids]
        for o in s.update_from_output(so, ModelRunnerOutput(ids, sampled)):
            outs.setdefault(o.req_id, []).append((tuple(o.new_token_ids), o.finish_reason, o.stop_reason))
        step += 1
        assert step < 500
    assert s.kv.num_free_blocks == s.kv.num_total_blocks and s.table.num_rows == 0
    return outs


def test_the_table_gives_each_requests_own_results(monkeypatch):
    bulk = _run(True, monkeypatch)
    monkeypatch.undo()
    own = _run(False, monkeypatch)
    assert bulk == own
    reasons = {rid: out[-1][1] for rid, out in bulk.items()}
    assert "stop" in reasons.values() and "length" in reasons.values()


def test_rows_are_reused_and_many_stop_ids_are_not_listed():
    t = RequestTable(2)
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=4, stop_token_ids=list(range(i * 40))), 4)
            for i in range(3)]
    slots = [t.add(r, 64) for r in reqs]
    assert sorted(slots) == [0, 1, 2] and t.capacity == 4
    assert [bool(t.listed[s]) for s in slots] == [True, False, False] and MAX_STOP_COLUMNS < 40
    t.remove(reqs[1])
    assert reqs[1].slot == -1 and t.add(reqs[1], 64) == slots[1] and t.num_rows == 3
