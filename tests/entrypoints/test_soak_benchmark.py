"""benchmarks/soak.py runs end to end on a few dozen requests (it starts its own server on the
embedded default model). Checks that it ran, covered every request category and wrote its JSON;
never a timing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_soak_benchmark_smoke(default_model, tmp_path):
    out = tmp_path / "soak.json"
    # through the router (issue 29's keyless category); the RSS and /health gates are the full
    # soak's: loose here, where a busy machine's timing must not fail a test
    cmd = [sys.executable, "benchmarks/soak.py", "--num-requests", "64", "--concurrency", "8", "--seed", "1",
           "--router", "--warmup", "4", "--rss-tolerance", "100", "--health-limit-s", "1000",
           "--out", str(out), "--server-log", str(tmp_path / "server.log"), "--",
           "--kv-cache-memory", "64MiB", "--cpu-threads", "1"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["num_requests"] == 64 and sum(s["categories"].values()) == 64
    assert set(s["categories"]) == {"ok", "abort", "malformed", "hostile", "router"}, s["categories"]
    assert all(k["5xx"] == 0 and k["unexpected"] == 0 for k in s["kinds"] if k["kind"].startswith("router/")), s
    assert s["gates"]["no_5xx"] and s["rss_after_warmup_mib"] > 0 and s["router"]
    assert s["status_5xx"] == 0 and s["stalls"] == 0 and s["idle_at_end"], s
    assert s["health_probes"] > 0 and s["rss_mib"]["peak"] > 0 and s["server_exit_code"] == 0
    assert "cpu_flags" in s["cpu"]
    assert "5xx" in r.stdout and "/health" in r.stdout
