"""guidellm's streaming benchmark against `pagedllm serve` (issue 33: guidellm always sends
``stream_options.continuous_usage_stats``; before it was implemented 0 of 64 requests succeeded).

Starts the server on a free port with the embedded default model (or --model), waits for /health,
runs ``guidellm benchmark`` (synchronous rate, --max-requests, synthetic prompts) and prints a table
of successful / errored requests with the load average and CPU flags; JSON with --json. When guidellm
is not installed (``pip install guidellm``; it is not in the dev extra: it pulls a large stack) it
says so and exits 2 without starting anything.

    python benchmarks/guidellm_stream.py --max-requests 64 --json /tmp/guidellm.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_info, print_table, write_json  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def count_requests(report: dict) -> tuple[int, int]:
    """(successful, errored) requests over the report's benchmarks (guidellm's JSON report)."""
    ok = err = 0
    for bench in report.get("benchmarks", []):
        totals = (bench.get("run_stats") or bench.get("request_totals") or {})
        if "successful" in totals:
            ok += int(totals.get("successful") or 0)
            err += int(totals.get("errored") or 0)
        else:
            reqs = bench.get("requests") or {}
            ok += len(reqs.get("successful") or [])
            err += len(reqs.get("errored") or [])
    return ok, err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    ap.add_argument("--max-requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--guidellm", default=None, help="the guidellm executable (default: on PATH)")
    args = ap.parse_args()
    guidellm = args.guidellm or shutil.which("guidellm")
    if guidellm is None or not os.path.exists(guidellm):
        print("guidellm is not installed (pip install guidellm): nothing run", file=sys.stderr)
        return 2
    model_dir = args.model or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                                           "tiny-shakespeare")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    load_before = open("/proc/loadavg").read().split()[:3]
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), "--served-model-name", "bench"]
    if args.model:
        cmd.insert(4, args.model)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, server)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "report.json")
            # guidellm 0.8's CLI: kind=...,field=... specs; the tokenizer is the model's own (no hub)
            run = subprocess.run([guidellm, "run", "--backend", f"kind=openai_http,target={url},model=bench",
                                  "--profile", "kind=synchronous",
                                  "--constraint", f"kind=max_requests,count={args.max_requests}",
                                  "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
                                  "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                                            f"output_tokens={args.output_tokens}",
                                  "--output", f"kind=json,path={out}", "--disable-console-interactive"],
                                 capture_output=True, text=True)
            if run.returncode != 0 or not os.path.exists(out):
                print(run.stdout[-2000:], run.stderr[-2000:], sep="\n", file=sys.stderr)
                return 1
            with open(out) as f:
                report = json.load(f)
    finally:
        server.terminate()
        server.wait(30)
    ok, err = count_requests(report)
    load_after = open("/proc/loadavg").read().split()[:3]
    row = {"requests": args.max_requests, "successful": ok, "errored": err,
           "load_before": " ".join(load_before), "load_after": " ".join(load_after)}
    print_table([row], list(row))
    write_json(args.json, {"command": sys.argv, "result": row, "cpu": cpu_info()})
    return 0 if ok == args.max_requests and err == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
