"""`pagedllm bench serve` (was benchmarks/serving.py), benchmarks/startup.py and benchmarks/cpu_gemm.py run end to end (tiny workloads)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_serving_benchmark_smoke(server, tmp_path, capsys):
    """benchmarks/serving.py became `pagedllm bench serve` (tests/entrypoints/test_bench_serve.py):
    its old command line, in bench's flags, with the old summary's figures."""
    from pagedllm.entrypoints.cli import main

    rc = main(["bench", "serve", "--base-url", server.url, "--model", "tiny", "--num-prompts", "6", "--request-rate",
               "20", "--input-len", "12", "--output-len", "4", "--random-range-ratio", "0.25", "--random-vocab-size",
               "500", "--ignore-eos", "--disable-tqdm", "--result-dir", str(tmp_path), "--result-filename", "s.json"])
    assert rc == 0
    s = json.loads((tmp_path / "s.json").read_text())["runs"][0]
    assert s["completed"] == 6 and s["failed"] == 0
    assert 6 * 3 <= s["total_output_tokens"] <= 6 * 5
    for key in ("ttft", "tpot", "itl"):
        assert s[f"median_{key}_ms"] > 0 and s[f"p99_{key}_ms"] >= s[f"median_{key}_ms"]
    out = capsys.readouterr().out
    assert "Time to First Token" in out and "Inter-token Latency" in out


@pytest.mark.slow
def test_startup_benchmark_smoke(llama_ckpt, tmp_path):
    out = tmp_path / "startup.json"
    cmd = [sys.executable, "benchmarks/startup.py", "--model", llama_ckpt, "--runs", "1", "--out", str(out), "--",
           "--kv-cache-memory", "16MiB"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["runs"][0]["ready_s"] > 0 and s["runs"][0]["exit_code"] == 0


def test_cpu_gemm_benchmark_smoke(tmp_path):
    from pagedllm.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: kernels unavailable")
    out = tmp_path / "gemm.json"
    cmd = [sys.executable, "benchmarks/cpu_gemm.py", "--rows", "1,7,100", "--layers", "1", "--hidden", "64",
           "--intermediate", "96", "--heads", "4", "--kv-heads", "2", "--vocab", "200", "--rounds", "1", "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["results"]
    assert [row["rows"] for row in rows] == [1, 7, 100]
    # It ran and wrote a figure per form; never a threshold on a timing (a stall can round one to 0).
    for row in rows:
        figures = {k: v for k, v in row.items() if "GFLOP/s" in k}
        assert figures and all(isinstance(v, (int, float)) and v >= 0 for v in figures.values()), row


def test_throughput_floor_arithmetic():
    """The floor of throughput_floor.py: model FLOPs and K/V bytes of the workload, counted by hand
    for two requests, at made-up rates (no timing involved)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from throughput_floor import floor_seconds, gemm_rate

    rates = [(1, 10.0), (100, 100.0)]
    assert gemm_rate(rates, 1) == 10.0 and gemm_rate(rates, 1000) == 100.0
    assert abs(gemm_rate(rates, 10) - 55.0) < 1e-9  # halfway in log(rows)
    shape = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    reqs = [([5] * 3, 2), ([5] * 4, 3)]  # (prompt, outputs)
    f = floor_seconds(shape, reqs, [(1, 1.0), (2, 1.0)], bandwidth=1e9, elt=2, vocab=10)
    params = 2 * (8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16)
    head = 2 * 10 * 8
    assert f["prompt_tokens"] == 7 and f["decode_tokens"] == 3  # steps k=1: 2 rows, k=2: 1 row
    assert f["model_flop"] == 7 * 2 * params + 3 * 2 * params + 5 * head
    kv = ((3 + 1) + (4 + 1) + (4 + 2)) * 2 * 2 * 1 * 4 * 2  # context per decode token x layers x K,V x kvh x hd x 2 B
    assert abs(f["decode_kv_GB"] * 1e9 - kv) < 1e-6
    assert abs(f["linear_decode_s"] - 3 * (2 * params + head) / 1e9) < 1e-15
