#!/usr/bin/env python
"""Data parallelism and prefix-aware routing on a shared-prefix workload.

Starts, one after another, (1) one ``pagedllm serve`` replica, (2) ``--data-parallel-size 2``
with prefix-aware routing, (3) ``--data-parallel-size 2`` with round-robin routing, and sends
each the same workload: ``--groups`` groups of requests, each group's prompts sharing a
``--prefix-len``-token prefix (a system prompt / document) followed by a unique
``--suffix-len``-token question; ``--num-prompts`` requests in random group order at
``--request-rate`` per second (Poisson), streamed, greedy, ``--output-len`` tokens each.

Every DP replica gets the same KV cache (``--kv-cache-memory``, default: room for
``--prefixes-per-replica`` group prefixes plus the running requests), so one replica cannot hold
every group's prefix, and round robin makes each of two replicas see every group, while
prefix-aware routing gives each replica about half of them. The single replica gets twice that
(the same total KV memory as DP=2) and every core. Reports the engines' prefix cache
hit rate (prompt tokens found cached / looked up, from /metrics), TTFT p50/p99 and throughput.

    python benchmarks/dp_router.py --out benchmarks/results/dp_router.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_info, ensure_model, print_table, write_json  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pagedllm.bench.datasets import SampleRequest  # noqa: E402
from pagedllm.bench.metrics import RequestResult, percentile  # noqa: E402
from pagedllm.bench.serve import request_body, send_request  # noqa: E402


def one_request(client, url: str, prompt: list[int], max_tokens: int):
    """A greedy streamed completion with ignore_eos (``pagedllm bench serve``'s request)."""
    body = request_body("openai", SampleRequest(prompt, len(prompt), max_tokens), None, ignore_eos=True,
                        temperature=0.0, extra_body=None)
    return send_request(client, url, "openai", body, {}, len(prompt))


def percentiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"mean": sum(s) / len(s) if s else math.nan, "p50": percentile(s, 50), "p90": percentile(s, 90),
            "p99": percentile(s, 99)}

CONFIGS = {
    "1 replica": [],
    "DP=2 prefix-aware": ["--data-parallel-size", "2", "--routing", "prefix"],
    "DP=2 round-robin": ["--data-parallel-size", "2", "--routing", "round_robin"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(args.prefix_len)] for _ in range(args.groups)]
    reqs = []
    for i in range(args.num_prompts):
        g = rng.randrange(args.groups)
        reqs.append((prefixes[g] + [rng.randrange(3, vocab) for _ in range(args.suffix_len)], g))
    return reqs


def cache_counters(url: str) -> tuple[float, float]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("pagedllm:prefix_cache_hits_total"), total("pagedllm:prefix_cache_queries_total")


def start(model: str, extra: list[str], args) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    replicas = int(extra[extra.index("--data-parallel-size") + 1]) if "--data-parallel-size" in extra else 1
    kv = args.kv_cache_memory * (2 // replicas)  # the same total KV memory in every configuration
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port),
           "--kv-cache-memory", str(kv), "--max-model-len", "2048", "--log-level", "warning",
           "--skip-tokenizer-init",
           *extra, *args.serve_args.split()]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    want = 2 if "--data-parallel-size" in extra else 1
    while True:
        try:
            r = httpx.get(f"{url}/metrics", timeout=2)
            up = len(re.findall(r"replica_up\{[^}]*\} 1", r.text)) if want > 1 else int(r.status_code == 200 and
                                                                                         httpx.get(f"{url}/health").status_code == 200)
            if up == want:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"server did not start: {cmd}")
        time.sleep(0.5)


async def drive(url: str, reqs, args) -> tuple[list[RequestResult], float]:
    import httpx

    endpoint = url + "/v1/completions"
    rng = random.Random(args.seed + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30),
                                 limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        t0 = time.perf_counter()
        for prompt, _ in reqs:
            tasks.append(asyncio.create_task(one_request(client, endpoint, prompt, args.output_len)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def run_config(name: str, model: str, reqs, args) -> dict:
    proc, url = start(model, CONFIGS[name], args)
    try:
        warm = asyncio.run(drive(url, [([5, 6, 7, 8] * 4, 0)], args))[0][0]
        if not warm.ok:
            raise SystemExit(f"{name}: warm-up failed: {warm.error}")
        h0, q0 = cache_counters(url)
        results, duration = asyncio.run(drive(url, reqs, args))
        h1, q1 = cache_counters(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    ok = [r for r in results if r.ok]
    ttft = percentiles([r.ttft for r in ok])
    return {"config": name, "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "prefix_cache_hit_rate": (h1 - h0) / max(1.0, q1 - q0), "ttft_s": ttft,
            "e2e_latency_s": percentiles([r.latency for r in ok]),
            "output_token_throughput": sum(r.output_len for r in ok) / duration}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny",
                    help="a benchmarks/common.py model name or a checkpoint directory (served with "
                         "--skip-tokenizer-init: the prompts are token ids, which the router hashes directly)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--request-rate", type=float, default=8.0)
    ap.add_argument("--prefixes-per-replica", type=int, default=5,
                    help="KV cache per replica sized for this many group prefixes plus 16 running requests")
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes per replica (overrides the above)")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--serve-args", default="", help="more pagedllm serve flags for every configuration "
                                                      "(one string, e.g. '--cpu-threads 1')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = args.model if os.path.isdir(args.model) else ensure_model(args.model)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    if args.kv_cache_memory is None:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) \
            * head_dim * 2  # bf16
        tokens = args.prefixes_per_replica * args.prefix_len + 16 * (args.suffix_len + args.output_len + 16)
        args.kv_cache_memory = per_token * tokens
    reqs = workload(args, cfg["vocab_size"])
    rows, results = [], []
    for name in args.configs:
        r = run_config(name, model, reqs, args)
        results.append(r)
        rows.append({"config": name, "hit rate": f"{100 * r['prefix_cache_hit_rate']:.1f}%",
                     "TTFT p50 (ms)": f"{1000 * r['ttft_s']['p50']:.0f}",
                     "TTFT p99 (ms)": f"{1000 * r['ttft_s']['p99']:.0f}",
                     "E2E p50 (ms)": f"{1000 * r['e2e_latency_s']['p50']:.0f}",
                     "out tok/s": f"{r['output_token_throughput']:.0f}", "failed": str(r["failed"])})
    print(f"\n{args.num_prompts} requests, {args.groups} groups x {args.prefix_len}-token prefix + "
          f"{args.suffix_len}-token suffix, {args.output_len} output tokens, rate {args.request_rate}/s, "
          f"KV cache {args.kv_cache_memory / 2**20:.1f} MiB per replica")
    print_table(rows, ["config", "hit rate", "TTFT p50 (ms)", "TTFT p99 (ms)", "E2E p50 (ms)", "out tok/s", "failed"])
    write_json(args.out, {"args": vars(args), "cpu": cpu_info(), "results": results})


if __name__ == "__main__":
    main()
