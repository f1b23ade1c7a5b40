"""Decode step cost against the number of rows: what a running batch larger than ~128 buys on CPU.

For each batch size B, B requests with ``--prompt-len``-token prompts are admitted and prefilled;
then ``--steps`` decode-only engine steps (every row samples, temperature 1.0) are timed, wall and
process CPU time. With ``--threads 1`` the CPU time is the work itself (no OpenMP waits), which
stays meaningful on a shared machine. Rounds repeat the sizes.

    python benchmarks/decode_batch_cost.py --model llama-tiny --batches 32,64,128,256,512 --threads 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, print_table, random_workload, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batches", default="32,64,128,256")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    ap.add_argument("--out", default="benchmarks/results/decode_batch_cost.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from pagedllm import LLM, SamplingParams

    llm = LLM(model=ensure_model(args.model), dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
              kv_cache_memory=2 << 30, max_num_seqs=max(batches), max_num_batched_tokens=8192,
              generation_config="vllm", cpu_threads=args.threads)
    engine = llm.engine

    def run(b: int) -> tuple[float, float]:
        sp = SamplingParams(max_tokens=args.steps + 4, ignore_eos=True, temperature=1.0)
        for p, _ in random_workload(b, prompt_range=(args.prompt_len, args.prompt_len)):
            engine.add_request(engine.new_request_id(), {"prompt_token_ids": p}, sp)
        while engine.get_stats().num_waiting:
            engine.step()
        for _ in range(2):  # past the last prefill chunk
            engine.step()
        w, c = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            engine.step()
        w, c = time.perf_counter() - w, time.process_time() - c
        while engine.has_unfinished_requests():
            engine.step()
        return w / args.steps, c / args.steps

    run(batches[0])  # warm-up
    rows = []
    for r in range(args.rounds):
        for b in batches:
            w, c = run(b)
            rows.append({"round": r, "rows": b, "wall_ms": round(w * 1e3, 2), "cpu_ms": round(c * 1e3, 2),
                         "cpu_us_per_row": round(c / b * 1e6, 1), "rows_per_wall_s": round(b / w)})
            print(rows[-1], flush=True)
    engine.shutdown()
    print(f"\nmodel={args.model} dtype={args.dtype} prompt_len={args.prompt_len} steps={args.steps} "
          f"threads={args.threads} load={os.getloadavg()[0]:.2f}")
    print_table(rows, ["round", "rows", "wall_ms", "cpu_ms", "cpu_us_per_row", "rows_per_wall_s"])
    write_json(args.out, {"args": vars(args), "results": rows, "argv": sys.argv})


if __name__ == "__main__":
    main()
