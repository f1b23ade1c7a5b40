"""/health while the server is saturated: GET /health every 100 ms (its own process, one kept-alive
connection) while ``--concurrency`` streaming completions run back to back, ``--num-requests`` in
all (each ``--max-tokens`` tokens, ignore_eos); the probe latencies' p50 / p99 / max (issue 31:
p99 under 50 ms) and the run's tokens per second.

    python benchmarks/health_saturated.py --num-requests 256 --concurrency 256 --max-tokens 64
    python benchmarks/health_saturated.py ... -- --max-num-seqs 256   # flags after -- go to serve
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402
from soak import start_server, stop_server  # noqa: E402


def probe(base: str, interval: float, stop, conn) -> None:
    """In its own process: the latency of each GET /health (None: no 200) until ``stop`` is set."""
    from common import HealthProbe

    health = HealthProbe(base, timeout=10)
    lat: list = []
    sent_at: list = []  # wall-clock time of each probe (to line a slow one up with a profile)
    while not stop.is_set():
        t = time.monotonic()
        sent_at.append(time.time())
        lat.append(time.monotonic() - t if health.status() == 200 else None)
        time.sleep(max(0.0, interval - (time.monotonic() - t)))
    conn.send((lat, sent_at))
    conn.close()


async def load(base: str, num: int, concurrency: int, max_tokens: int) -> tuple[int, int]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    tokens = errors = 0
    kinds: dict[str, int] = {}  # what the errors were: "HTTP <status>: <body>" or the client's exception

    def failed(what: str) -> None:
        nonlocal errors
        errors += 1
        kinds[what[:200]] = kinds.get(what[:200], 0) + 1
    body = {"model": "tiny-shakespeare", "prompt": "To be, or not to be", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}

    async def one(client, i):
        nonlocal tokens, errors
        async with sem:
            try:
                async with client.stream("POST", base + "/v1/completions", json=dict(body, seed=i)) as r:
                    if r.status_code != 200:
                        failed(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
                        return
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            tokens += 1
            except httpx.HTTPError as e:
                failed(f"{type(e).__name__}: {e}")

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client, i) for i in range(num)))
    return tokens, errors, kinds


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded tiny-shakespeare)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--client-nice", type=int, default=0,
                    help="run the load generator at this niceness (after the server and the probe started), so "
                         "on a small machine it yields to them as a client on another host would not compete")
    ap.add_argument("--out", default="benchmarks/results/health_saturated.json")
    ap.add_argument("serve_args", nargs="*", help="after --: extra `pagedllm serve` flags")
    args = ap.parse_args()
    load_before = open("/proc/loadavg").read().split()[:3]
    proc, base, cmd, _ = start_server(args.model, args.serve_args, "/tmp/health_saturated_server.log", 600)
    try:
        stop = multiprocessing.Event()
        recv, send = multiprocessing.Pipe(duplex=False)
        prober = multiprocessing.Process(target=probe, args=(base, args.interval, stop, send))
        prober.start()
        if args.client_nice:
            os.nice(args.client_nice)
        t0 = time.monotonic()
        tokens, errors, error_kinds = asyncio.run(load(base, args.num_requests, args.concurrency, args.max_tokens))
        wall = time.monotonic() - t0
        stop.set()
        lat, sent_at = recv.recv()
        prober.join()
    finally:
        code = stop_server(proc)
    ok = [x for x in lat if x is not None]
    row = {"probes": len(lat), "non_200": len(lat) - len(ok), "p50_ms": round(1000 * pct(ok, 0.5), 1),
           "p99_ms": round(1000 * pct(ok, 0.99), 1), "max_ms": round(1000 * max(ok, default=float("nan")), 1),
           "tok_s": round(tokens / wall, 1), "errors": errors, "exit": code}
    load_after = open("/proc/loadavg").read().split()[:3]
    print(f"{args.num_requests} streams x {args.max_tokens} tokens, concurrency {args.concurrency}, "
          f"serve {' '.join(args.serve_args)}; load {load_before} -> {load_after}")
    print_table([row], list(row))
    for what, n in error_kinds.items():
        print(f"error x{n}: {what}")
    write_json(args.out, {"args": vars(args), "cmd": cmd, "load_before": load_before, "load_after": load_after,
                          "result": row, "error_kinds": error_kinds, "latencies_s": lat,
                          "probe_sent_at": sent_at})


if __name__ == "__main__":
    main()
