#!/usr/bin/env python
"""Online serving benchmark against any OpenAI-compatible server (pagedllm, vLLM, ...).

Workload: the throughput benchmark's (benchmarks/common.py random_workload): N requests with
prompts of uniform [64, 512] random token ids and outputs of uniform [32, 256] tokens, greedy,
``ignore_eos`` (sent in the body, as vLLM does), streamed from /v1/completions. Requests arrive
as a Poisson process at --request-rate per second (``inf``: all at once).

Reports request throughput, output and total token throughput, and mean/p50/p90/p99 of time
to first token (TTFT), time per output token after the first (TPOT), inter-token latency
(ITL: the gaps between streamed chunks) and end-to-end latency.

    pagedllm serve &                                          # the default model (vocab 2048)
    python benchmarks/serving.py --vocab-size 2048 --num-prompts 100 --request-rate 2
    pagedllm serve .cache/bench-models/llama-tiny --skip-tokenizer-init &   # benchmarks/common.py models
    python benchmarks/serving.py --num-prompts 200 --request-rate 4 --out benchmarks/results/serving.json
    python benchmarks/serving.py --base-url http://other-host:8000 --model my-model --request-rate inf
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, random_workload, write_json  # noqa: E402


@dataclass
class Result:
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


async def one_request(client, url: str, model: Optional[str], prompt: list[int], max_tokens: int,
                      api_key: Optional[str]) -> Result:
    import httpx

    res = Result(len(prompt), max_tokens)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    last = None
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])[:200]
                    return res
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
                if not msg.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.ok = last is not None
    return res


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    s = sorted(xs)

    def pct(p):
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": statistics.fmean(s), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


async def run(args) -> dict:
    import httpx

    reqs = random_workload(args.num_prompts, seed=args.seed, prompt_range=tuple(args.input_len_range),
                           output_range=tuple(args.output_len_range), vocab=args.vocab_size)
    url = args.base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        warm = await one_request(client, url, args.model, reqs[0][0][:16], 4, args.api_key)
        if not warm.ok:
            raise SystemExit(f"warm-up request failed: {warm.error}")

        async def limited(prompt, n):
            if sem is None:
                return await one_request(client, url, args.model, prompt, n, args.api_key)
            async with sem:
                return await one_request(client, url, args.model, prompt, n, args.api_key)

        tasks = []
        t0 = time.perf_counter()
        for prompt, n in reqs:
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results: list[Result] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "base_url": args.base_url, "model": args.model, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "seed": args.seed,
        "input_len_range": args.input_len_range, "output_len_range": args.output_len_range,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles(tpot),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_latency_s": percentiles([r.latency for r in ok]),
    }
    if args.save_details:
        summary["requests"] = [asdict(r) for r in results]
    return summary


def report(s: dict) -> None:
    print(f"\n{s['completed']} requests completed ({s['failed']} failed) in {s['duration_s']:.2f} s "
          f"at request rate {s['request_rate']}/s")
    for e in s["errors"]:
        print("  error:", e)
    print(f"request throughput     {s['request_throughput']:.2f} req/s")
    print(f"output token throughput {s['output_token_throughput']:.1f} tok/s")
    print(f"total token throughput {s['total_token_throughput']:.1f} tok/s\n")
    rows = []
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E latency", "e2e_latency_s")):
        p = s[key]
        rows.append({"metric (ms)": name, **{k: f"{v * 1000:.1f}" for k, v in p.items()}})
    print_table(rows, ["metric (ms)", "mean", "p50", "p90", "p99"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's default)")
    ap.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"))
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (inf: burst)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    ap.add_argument("--input-len-range", type=int, nargs=2, default=[64, 512])
    ap.add_argument("--output-len-range", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--vocab-size", type=int, default=32000, help="random prompt token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    ap.add_argument("--save-details", action="store_true", help="include every request in the JSON")
    args = ap.parse_args()
    summary = asyncio.run(run(args))
    report(summary)
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
