"""Time to first token of a short request while one client's largest allowed request runs.

One client sends the biggest request the server admits (``n`` = --max-n, ``max_tokens`` = the
context's room, ignore_eos; or a prompt of the whole context); once its first chunk is back, a
second client sends short requests one after another (``--probes``, 1 token each) and their TTFT
is measured. A server that gives one request every running slot makes the short ones wait for it
(tens of seconds); one that holds a request to its share (``--max-num-seqs-per-request``) answers
them at once.

    python benchmarks/fairness.py                          # the embedded default model, defaults
    python benchmarks/fairness.py --out results/fairness.json -- --max-num-seqs-per-request 128

Flags after ``--`` go to ``pagedllm serve``. Prints a table (one row per big request kind) and
writes JSON with the CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402
from soak import start_server, stop_server  # noqa: E402

MODEL = "tiny-shakespeare"


async def first_chunk_then_rest(client, base: str, body: dict, started: asyncio.Event) -> float:
    """Stream ``body``; set ``started`` at its first chunk; its total seconds."""
    t0 = time.monotonic()
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the big request got {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                started.set()
    return time.monotonic() - t0


async def ttft(client, base: str) -> float:
    t0 = time.monotonic()
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 1, "temperature": 0, "stream": True}
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"a short request got {r.status_code}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - t0
    raise RuntimeError("a short request streamed nothing")


async def measure(base: str, big: dict, probes: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        started = asyncio.Event()
        task = asyncio.create_task(first_chunk_then_rest(client, base, big, started))
        await asyncio.wait_for(started.wait(), 600)
        times = []
        for _ in range(probes):
            if task.done():
                break
            times.append(await ttft(client, base))
        big_s = await task
    times.sort()
    return {"probes": len(times), "ttft_p50_s": round(times[len(times) // 2], 3) if times else None,
            "ttft_max_s": round(times[-1], 3) if times else None, "big_request_s": round(big_s, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    ap.add_argument("--max-n", type=int, default=128, help="the server's --max-n (the big request's n)")
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("serve_args", nargs="*", help="after --: flags for pagedllm serve")
    args = ap.parse_args()
    log = tempfile.NamedTemporaryFile(prefix="fairness-", suffix=".log", delete=False).name
    proc, base, _, _ = start_server(args.model, ["--max-n", str(args.max_n), *args.serve_args], log, 300)
    load = os.getloadavg()
    try:
        bigs = {
            f"n={args.max_n}, max_tokens={args.max_tokens}": {
                "model": MODEL, "prompt": "First Citizen:", "n": args.max_n, "max_tokens": args.max_tokens,
                "temperature": 0.8, "ignore_eos": True, "stream": True},
        }
        rows = []
        for kind, body in bigs.items():
            rows.append({"big request": kind, **asyncio.run(measure(base, body, args.probes))})
    finally:
        stop_server(proc)
    print_table(rows, ["big request", "probes", "ttft_p50_s", "ttft_max_s", "big_request_s"])
    print(f"load average: {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    write_json(args.out, {"rows": rows, "serve_args": args.serve_args, "loadavg_start": load,
                          "loadavg_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
