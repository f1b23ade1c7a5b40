#!/usr/bin/env python
"""Time from launching ``pagedllm serve`` to the first ``GET /health`` answered 200.

    python benchmarks/startup.py                       # the embedded default model
    python benchmarks/startup.py --model /path/to/ckpt --runs 5 --out startup.json

Each run starts a fresh server process on a free port, polls /health every 20 ms, records the
time of the first HTTP answer of any status ("listening") and of the first 200 ("ready"),
then stops the server with SIGTERM and checks that it exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _cpu_seconds(pid: int) -> float | None:
    """user + system CPU time of a process (Linux), to compare runs on a busy machine."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def one_run(model: str | None, extra: list[str], timeout: float) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve"] + ([model] if model else [])
    cmd += ["--port", str(port), "--log-level", "warning"] + extra
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    listening = ready = cpu = None
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            code = _status(f"http://127.0.0.1:{port}/health")
            now = time.perf_counter() - t0
            if code is not None and listening is None:
                listening = now
            if code == 200:
                ready, cpu = now, _cpu_seconds(proc.pid)
                break
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    return {"listening_s": listening, "ready_s": ready, "cpu_s_at_ready": cpu, "exit_code": rc}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="extra flags for pagedllm serve (after --)")
    args = ap.parse_args()
    extra = [a for a in args.serve_args if a != "--"]
    runs = [one_run(args.model, extra, args.timeout) for _ in range(args.runs)]
    ready = [r["ready_s"] for r in runs if r["ready_s"] is not None]
    summary = {
        "model": args.model or "default (models/tiny-shakespeare)",
        "runs": runs,
        "ready_s_median": statistics.median(ready) if ready else None,
        "ready_s_min": min(ready) if ready else None,
        "ready_s_max": max(ready) if ready else None,
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    print(f"{'run':>4} {'listening (s)':>14} {'/health 200 (s)':>16} {'CPU used (s)':>13} {'exit':>5}")
    for i, r in enumerate(runs):
        fmt = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
        print(f"{i:>4} {fmt(r['listening_s']):>14} {fmt(r['ready_s']):>16} {fmt(r['cpu_s_at_ready']):>13} "
              f"{r['exit_code']:>5}")
    if ready:
        print(f"median {summary['ready_s_median']:.2f} s to /health 200 (min {summary['ready_s_min']:.2f}, "
              f"max {summary['ready_s_max']:.2f}); load average {summary['load_average'][0]:.2f} on "
              f"{summary['cpus']} CPUs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
