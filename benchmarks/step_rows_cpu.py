"""The host's per-row cost of a step, by process CPU time at one thread: meaningful on a shared host.

step_micro.py's workload (a 1-layer hidden-64 vocab-1024 Llama, B requests x 8-token prompts,
128 greedy tokens each), run with ``cpu_threads=1`` so that the process's CPU time is the step's
work itself (no OpenMP threads spinning, no time spent waiting for a core): CPU ms per step at
each B, and the per-row cost between the smallest and the largest B (what grows with the batch:
scheduling, input preparation, sampling metadata, output processing). Each ``--tree`` (a source
tree put first on PYTHONPATH, e.g. main's and a branch's) runs in its own process; ``--rounds``
alternates them and the best round is kept.

    python benchmarks/step_rows_cpu.py --tree main=/work/main --tree branch=$PWD --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402
from step_micro import DECODE_TOKENS, ensure_micro_model, load_average, prompts  # noqa: E402


def child(model: str, batches: list[int]) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=max(batches),
              kv_cache_memory=64 << 20, cpu_threads=1)
    sp = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts(4), sampling_params=sp, use_tqdm=False)  # warm-up
    out = {}
    for b in batches:
        c0, w0 = time.process_time(), time.perf_counter()
        llm.generate(prompt_token_ids=prompts(b), sampling_params=sp, use_tqdm=False)
        out[str(b)] = {"cpu_ms": (time.process_time() - c0) / DECODE_TOKENS * 1e3,
                       "wall_ms": (time.perf_counter() - w0) / DECODE_TOKENS * 1e3}
    return out


def run_child(script: str, name: str, path: str, *argv: str) -> dict:
    """``script --child ARGV...`` with ``path`` first on PYTHONPATH at one OpenMP thread: its RESULT line."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(script), "--child", *argv],
                          capture_output=True, text=True, env=env, timeout=3600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{name}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(sys.argv[2], [int(b) for b in sys.argv[3].split(",")])), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                    help="a source tree to measure (put first on PYTHONPATH)")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/step_rows_cpu.json")
    args = ap.parse_args()
    model = ensure_micro_model()
    trees = [t.split("=", 1) for t in args.tree]
    batches = [int(b) for b in args.batches.split(",")]
    load_before = load_average()
    best: dict = {}
    for r in range(args.rounds):
        for name, path in trees:
            res = run_child(__file__, name, path, model, args.batches)
            print(f"{name} round {r}: " + ", ".join(f"B={b} {v['cpu_ms']:.2f} cpu ms" for b, v in res.items()),
                  flush=True)
            for b, v in res.items():
                cur = best.setdefault(name, {}).get(b)
                if cur is None or v["cpu_ms"] < cur["cpu_ms"]:
                    best[name][b] = v
    lo, hi = str(batches[0] if len(batches) < 3 else batches[-2]), str(batches[-1])
    rows, per_row_col = [], f"us/row {lo}->{hi}"
    for name, _ in trees:
        per_row = (best[name][hi]["cpu_ms"] - best[name][lo]["cpu_ms"]) / (int(hi) - int(lo)) * 1e3
        row = {"tree": name, per_row_col: f"{per_row:.1f}"}
        row.update({f"B={b} cpu ms/step": f"{best[name][str(b)]['cpu_ms']:.2f}" for b in batches})
        rows.append(row)
    print_table(rows, ["tree"] + [f"B={b} cpu ms/step" for b in batches] + [per_row_col])
    write_json(args.out, {"best": best, "trees": dict(trees), "batches": batches, "rounds": args.rounds,
                          "load_before": load_before, "load_after": load_average(),
                          "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
