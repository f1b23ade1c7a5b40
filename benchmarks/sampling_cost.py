"""What sampling costs beside the forward pass: the decode step time of a batch under greedy
decoding, temperature 1.0 (vLLM's client default), temperature 0.8 with top-p 0.9 / top-k 50,
and seeded requests, on the same model and prompts.

The batch is admitted and prefilled first; then D decode-only engine steps are timed (every row
samples in each). Rounds alternate the settings; the best round of each counts.

    python benchmarks/sampling_cost.py --model llama-tiny --batch 32
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, print_table, random_workload, write_json  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1.0": dict(temperature=1.0),
    "t=0.8 top_p=0.9 top_k=50": dict(temperature=0.8, top_p=0.9, top_k=50),
    "temperature 1.0, seeded": dict(temperature=1.0, seed=1),
    "t=1.0 repetition_penalty=1.1": dict(temperature=1.0, repetition_penalty=1.1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/sampling_cost.json")
    args = ap.parse_args()

    from pagedllm import LLM, SamplingParams

    path = ensure_model(args.model) if not os.path.isdir(args.model) else args.model
    llm = LLM(model=path, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
              kv_cache_memory=1 << 30, max_num_seqs=args.batch, generation_config="vllm")
    prompts = [{"prompt_token_ids": p} for p, _ in random_workload(args.batch, prompt_range=(args.prompt_len,) * 2)]

    engine = llm.engine

    def step_time(kw: dict) -> float:
        """Mean time of the decode-only steps: every request admitted and past its prefill first."""
        sp = SamplingParams(max_tokens=2 + args.decode_tokens, ignore_eos=True, **kw)
        for p in prompts:
            engine.add_request(engine.new_request_id(), p, sp)
        while engine.get_stats().num_waiting or engine.num_forward_tokens < prefill_tokens[0]:
            engine.step()
        engine.step()  # the first all-decode step
        t = time.perf_counter()
        for _ in range(args.decode_tokens):
            engine.step()
        dt = (time.perf_counter() - t) / args.decode_tokens
        while engine.has_unfinished_requests():
            engine.step()
        return dt

    prefill_tokens = [0]
    step_time(SETTINGS["temperature 1.0"])  # warm-up
    best = {name: float("inf") for name in SETTINGS}
    for _ in range(args.rounds):
        for name, kw in SETTINGS.items():
            prefill_tokens[0] = engine.num_forward_tokens + args.batch * args.prompt_len
            best[name] = min(best[name], step_time(kw))
    base = best["greedy"]
    rows = [{"sampling": name, "step_ms": round(s * 1e3, 2), "vs_greedy": round(s / base, 2)} for name, s in best.items()]
    llm.engine.shutdown()
    print(f"\nmodel={args.model} dtype={args.dtype} batch={args.batch} prompt_len={args.prompt_len} "
          f"decode_tokens={args.decode_tokens}")
    print_table(rows, ["sampling", "step_ms", "vs_greedy"])
    write_json(args.out, {"args": vars(args), "results": rows, "argv": sys.argv})


if __name__ == "__main__":
    main()
