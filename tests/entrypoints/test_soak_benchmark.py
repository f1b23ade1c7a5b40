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


def _bench_modules():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import soak
    import soak_surfaces

    return soak, soak_surfaces


def test_soak_surfaces_workload_covers_every_surface():
    """--surfaces all: every surface's requests are drawn (no server started here), each on the
    server that serves it, with well-formed JSON where the kind is not malformed on purpose; the
    default mix keeps its own share, and the default mode's workload is unchanged by it."""
    soak, surf = _bench_modules()
    ctx = surf.Context(0, surf.SURFACES, {"lora": {n: "/adapters/" + n for n in surf.LORA_NAMES}})
    specs = soak.workload(3000, 0, 1 << 20, surfaces=ctx)
    cats = {s.kind.split("/")[0] for s in specs}
    assert cats == set(surf.SURFACES) | {"ok", "abort", "malformed", "hostile"}, cats
    assert {s.server for s in specs} == {"gen", "llava", "embed", "rerank"}
    assert all(s.server == "llava" for s in specs if s.kind.startswith("images/") and "text_model" not in s.kind)
    assert all(s.server in ("embed", "rerank") for s in specs if s.kind.startswith("pooling/"))
    assert any(s.flow is not None for s in specs) and all(s.body is None for s in specs if s.flow is not None)
    for s in specs:
        if s.body is not None and s.kind.split("/")[0] in surf.SURFACES and not s.kind.endswith("bad_json"):
            json.loads(s.body)
    default = sum(1 for s in specs if s.kind.split("/")[0] in ("ok", "abort", "malformed", "hostile"))
    assert abs(default / len(specs) - surf.base_share(surf.SURFACES)) < 0.05
    plain = soak.workload(300, 0, 1 << 20)
    assert {s.server for s in plain} == {"gen"} and not any(s.flow for s in plain)
    warm = surf.warmup_specs(0, ctx, soak.Spec)
    assert {s.kind.split("/")[0] for s in warm} == set(surf.SURFACES)
    assert all(s.expect[0] == "2xx" and s.abort is None for s in warm)


def test_soak_surfaces_smoke(default_model, tmp_path):
    """--surfaces of the generating server (LoRA adapters built at start-up, the disk KV tier,
    tools, responses flows, grammars, beams) end to end on a few dozen requests; the image and
    pooling servers are left to the full soak (their start-up would double this test's time)."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "benchmarks/soak.py", "--surfaces", "responses,tools,structured,beam,lora,kv_tier",
           "--num-requests", "80", "--concurrency", "8", "--seed", "1", "--warmup", "4", "--rss-tolerance", "100",
           "--health-limit-s", "1000", "--health-p99-limit-s", "1000", "--out", str(out),
           "--server-log", str(tmp_path / "server.log"), "--", "--cpu-threads", "1"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["num_requests"] == 80 and s["http_requests"] > 80, s["http_requests"]
    assert set(s["servers"]) == {"gen"} and s["surfaces"] == ["responses", "tools", "structured", "beam", "lora",
                                                              "kv_tier"]
    assert {"responses", "lora", "ok"} <= set(s["categories"]), s["categories"]
    assert s["status_5xx"] == 0 and s["stalls"] == 0 and s["idle_at_end"] and s["server_exit_code"] == 0, s
    assert s["health_p99_s"] is not None and s["kv_tier"] is not None
    assert "--enable-lora" in s["server_cmd"] and "--kv-offloading-size" in s["server_cmd"]
