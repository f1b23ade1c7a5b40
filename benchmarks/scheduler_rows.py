"""The scheduler's own cost per decode row, without a model: B running requests (8-token prompts,
prefix caching on, block size 16), each step ``schedule()`` then ``update_from_output()`` with
one made-up token per row, as the engine calls them; microseconds per row per step for each
phase, at one thread of Python. Engine-free, so it isolates what issue 31's per-row target
depends on in the core (step_micro.py measures the whole step).

    python benchmarks/scheduler_rows.py --batch 256 --steps 128 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402


def run(batch: int, steps: int) -> dict:
    from pagedllm.core.contracts import ModelRunnerOutput
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler import Scheduler, SchedulerLimits
    from pagedllm.sampling_params import SamplingParams

    block = 16
    blocks = batch * (-(-(8 + steps + 2) // block)) + 8
    s = Scheduler(SchedulerLimits(batch, max(8192, 8 * batch), 4096), KVCacheManager(blocks, block, True))
    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0)
    for i in range(batch):
        s.add_request(Request(f"r{i}", [3 + (7 * i + 13 * j) % 1000 for j in range(8)], sp, max_tokens=steps + 1))
    t_sched = t_update = 0.0
    for k in range(steps + 1):
        t0 = time.perf_counter()
        so = s.schedule()
        t1 = time.perf_counter()
        ids = list(so.num_scheduled_tokens)
        s.update_from_output(so, ModelRunnerOutput(ids, [[5 + k % 7] for _ in ids]))
        t2 = time.perf_counter()
        if k:  # the first step is the prefill
            t_sched += t1 - t0
            t_update += t2 - t1
    assert not s.running and s.kv.num_free_blocks == s.kv.num_total_blocks
    per = 1e6 / (steps * batch)
    return {"schedule_us_per_row": t_sched * per, "update_us_per_row": t_update * per}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="runs; the best is kept")
    ap.add_argument("--out", default="benchmarks/results/scheduler_rows.json")
    args = ap.parse_args()
    runs = [run(args.batch, args.steps) for _ in range(args.repeats)]
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    rows = [{"batch": args.batch, **{k: round(v, 3) for k, v in best.items()}}]
    print_table(rows, ["batch", "schedule_us_per_row", "update_us_per_row"])
    write_json(args.out, {"args": vars(args), "best": best, "runs": runs})


if __name__ == "__main__":
    main()
