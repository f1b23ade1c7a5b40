"""Pipeline parallelism: the ids sampled since the workers last saw a request travel in its
CachedRequestData (new_token_ids), exactly once each; without PP the diffs carry none."""
import pytest

from pagedllm.core.contracts import ModelRunnerOutput
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams


def run(send: bool, steps: int = 6):
    s = Scheduler(SchedulerLimits(4, 5, 128, send_new_token_ids=send), KVCacheManager(32, 4, True))
    s.add_request(Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), max_tokens=8))
    worker_tokens = {}  # what a pipeline stage holds: the sent tokens, never its own samples
    for step in range(steps):
        so = s.schedule()
        for nr in so.scheduled_new_reqs:
            worker_tokens[nr.req_id] = list(nr.token_ids)
        for cr in so.scheduled_cached_reqs:
            worker_tokens[cr.req_id] += cr.new_token_ids
        ids = list(so.num_scheduled_tokens)
        sampled = [[100 + step] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        s.update_from_output(so, ModelRunnerOutput(ids, sampled))
    return s, worker_tokens


@pytest.mark.parametrize("send", [True, False])
def test_sampled_ids_reach_the_workers_in_the_diffs_once(send):
    s, held = run(send)
    req = s.requests["a"]
    assert req.status == RequestStatus.RUNNING
    if send:  # the stage's copy is the scheduler's, up to the last token (sampled by the last step, sent next)
        assert held["a"] == req.all_token_ids[:-1]
    else:  # the sampling rank appends its own tokens: the diffs carry none
        assert held["a"] == req.all_token_ids[:len(held["a"])] and len(held["a"]) < req.num_tokens - 1
