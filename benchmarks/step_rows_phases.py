"""Host microseconds per running row, per phase of a decode step.

step_micro.py's workload (a 1-layer hidden-64 vocab-1024 Llama, 8-token prompts, 128 greedy
tokens each, ``cpu_threads=1``) driven step by step through LLMEngine, with each phase of the
step timed: the scheduler's ``schedule``, the runner's diffs, input preparation, forward,
sampling and state update, the scheduler's ``update_from_output`` and the front end's output
processing. For each B the median over the steady decode steps; the per-row cost of a phase is
its growth from the smaller to the larger B divided by the rows added. Each ``--tree`` (a source
tree put first on PYTHONPATH) runs in its own process; ``--rounds`` alternates them, the best
round (lowest total) is kept.

    python benchmarks/step_rows_phases.py --tree main=. --rounds 2
    python benchmarks/step_rows_phases.py --tree before=/path/to/old --tree after=. --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402
from step_micro import DECODE_TOKENS, ensure_micro_model, load_average, prompts  # noqa: E402
from step_rows_cpu import run_child  # noqa: E402

RUNNER_PHASES = ("diffs", "prepare", "forward", "sample", "states")
PHASES = ("schedule",) + RUNNER_PHASES + ("update", "output", "total")


def _timed(cls, name: str, phase: str, acc: dict) -> None:
    inner = getattr(cls, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            acc[phase] = acc.get(phase, 0.0) + time.perf_counter() - t0

    setattr(cls, name, wrapper)


def child(model: str, batches: list[int]) -> dict:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.worker.model_runner import ModelRunner

    acc: dict[str, float] = {}
    for name, phase in (("_apply_diffs", "diffs"), ("_prepare_inputs", "prepare"), ("_forward", "forward"),
                        ("_sample", "sample"), ("_update_states", "states")):
        if hasattr(ModelRunner, name):
            _timed(ModelRunner, name, phase, acc)
    engine = LLMEngine(EngineConfig(model=model, dtype="bfloat16", max_num_seqs=max(batches),
                                    kv_cache_memory=64 << 20, cpu_threads=1),
                       skip_tokenizer_init=True)
    sp = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    out = {}
    for b in [4] + batches:  # the first: warm-up
        for ids in prompts(b):
            engine.add_request(None, {"prompt_token_ids": ids}, sp)
        steps: list[dict] = []
        while engine.has_unfinished_requests():
            acc.clear()
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            timing = engine.last_core_outputs.timing
            row = {p: acc.get(p, 0.0) for p in RUNNER_PHASES}
            row.update(schedule=timing.schedule, update=timing.update, output=engine.last_output_seconds,
                       total=total)
            steps.append(row)
        decode = steps[2:-2]  # the steady decode steps: no prefill, no finishing step
        out[str(b)] = {p: 1e3 * statistics.median(s[p] for s in decode) for p in PHASES}
    engine.shutdown()
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(sys.argv[2], [int(b) for b in sys.argv[3].split(",")])), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                    help="a source tree to measure (put first on PYTHONPATH)")
    ap.add_argument("--batches", default="64,256", help="two batch sizes: the per-row cost is between them")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/step_rows_phases.json")
    args = ap.parse_args()
    model = ensure_micro_model()
    trees = [t.split("=", 1) for t in args.tree]
    lo, hi = args.batches.split(",")
    load_before = load_average()
    best: dict = {}
    for r in range(args.rounds):
        for name, path in trees:
            res = run_child(__file__, name, path, model, args.batches)
            print(f"{name} round {r} (load {open('/proc/loadavg').read().split()[0]}): " + ", ".join(
                f"B={b} {v['total']:.3f} ms" for b, v in res.items()), flush=True)
            if name not in best or res[hi]["total"] < best[name][hi]["total"]:
                best[name] = res
    rows = []
    for name, _ in trees:
        res = best[name]
        for p in PHASES:
            per_row = (res[hi][p] - res[lo][p]) / (int(hi) - int(lo)) * 1e3
            rows.append({"tree": name, "phase": p, f"B={lo} ms": f"{res[lo][p]:.3f}",
                         f"B={hi} ms": f"{res[hi][p]:.3f}", f"us/row {lo}->{hi}": f"{per_row:.2f}"})
    load_after = load_average()
    print(f"\nmedian ms per decode step and host us per added row, cpu_threads=1; load {load_before} -> {load_after}")
    print_table(rows, ["tree", "phase", f"B={lo} ms", f"B={hi} ms", f"us/row {lo}->{hi}"])
    write_json(args.out, {"best": best, "load_before": load_before, "load_after": load_after})


if __name__ == "__main__":
    main()
