"""Prefix caching: every prompt = one shared 2000-token prefix + a distinct 50-token suffix,
32 output tokens. Measures TTFT with requests sent one after another and all at once, and
throughput, with prefix caching on vs off, in one run.

    python benchmarks/prefix_caching.py --model llama-tiny --num-requests 16
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, print_table, write_json  # noqa: E402


def workload(n, prefix_len, suffix_len, seed=0, vocab=32000):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(suffix_len)] for _ in range(n)]


def ttft_sequential(llm, prompts, sp):
    """Time to first token of each request when it arrives alone (after the previous finished)."""
    eng = llm.engine
    ttfts = []
    for p in prompts:
        t = time.perf_counter()
        eng.add_request(None, p, sp)
        first = None
        while eng.has_unfinished_requests():
            eng.step()
            if first is None:
                first = time.perf_counter() - t  # a 2050-token prompt fits one step: its first token
        ttfts.append(first)
    return ttfts


def run_all_at_once(llm, prompts, sp):
    """All requests submitted together: TTFT of each and total throughput."""
    from pagedllm.engine.llm_engine import OUTPUT_CUMULATIVE

    eng = llm.engine
    t = time.perf_counter()
    ids = [eng.add_request(None, p, sp, output_kind=OUTPUT_CUMULATIVE) for p in prompts]
    first = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - t
    return [first[i] for i in ids], time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=50)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--out", default="benchmarks/results/prefix_caching.json")
    args = ap.parse_args()
    from pagedllm import LLM, SamplingParams

    path = ensure_model(args.model) if not os.path.isdir(args.model) else args.model
    prompts = workload(args.num_requests, args.prefix_len, args.suffix_len)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    total_tokens = len(prompts) * (args.prefix_len + args.suffix_len + args.output_len)
    rows = []
    for caching in (False, True):
        llm = LLM(model=path, dtype=args.dtype, enable_prefix_caching=caching, skip_tokenizer_init=True,
                  kv_cache_memory=2 << 30, max_num_batched_tokens=args.max_num_batched_tokens)
        warm = workload(1, args.prefix_len, args.suffix_len, seed=99)  # a different prefix: no hits
        ttft_sequential(llm, warm, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        seq = ttft_sequential(llm, prompts, sp)
        llm.reset_prefix_cache()
        burst_ttft, burst_time = run_all_at_once(llm, prompts, sp)
        stats = llm.get_stats()
        rows.append({
            "prefix_caching": "on" if caching else "off",
            "ttft_seq_p50_ms": round(statistics.median(seq) * 1e3, 1),
            "ttft_seq_first_ms": round(seq[0] * 1e3, 1),
            "ttft_burst_p50_ms": round(statistics.median(burst_ttft) * 1e3, 1),
            "burst_tok_s": round(total_tokens / burst_time, 1),
            "hit_rate": round(stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1), 3),
        })
        print(rows[-1], flush=True)
    off, on = rows
    ratio = off["ttft_seq_p50_ms"] / on["ttft_seq_p50_ms"]
    print(f"\nmodel={args.model} requests={args.num_requests} prefix={args.prefix_len} suffix={args.suffix_len} "
          f"output={args.output_len}")
    print_table(rows, list(rows[0]))
    print(f"TTFT (sequential) ratio off/on: {ratio:.1f}x; burst throughput ratio: {on['burst_tok_s'] / off['burst_tok_s']:.1f}x")
    write_json(args.out, {"args": vars(args), "results": rows, "ttft_ratio": ratio})


if __name__ == "__main__":
    main()
