"""`pagedllm bench throughput` and `pagedllm bench latency` on the tiny checkpoint: the engine
in the process, the figures counted from its outputs, JSON and charts written."""
from __future__ import annotations

import json

from pagedllm.entrypoints.cli import main
from png_files import png_size

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "128"]


def test_throughput(llama_ckpt, tmp_path, capsys):
    rc = main(["bench", "throughput", "--model", llama_ckpt, "--num-prompts", "3", "--input-len", "8", "--output-len",
               "4", "--random-range-ratio", "0.5", "--result-dir", str(tmp_path), "--result-filename", "t.json",
               "--plot", *ENGINE])
    assert rc == 0
    res = json.loads((tmp_path / "t.json").read_text())
    assert res["kind"] == "throughput" and res["command"].startswith("pagedllm bench throughput --model")
    from pagedllm.bench.datasets import random_requests

    want = random_requests(3, 8, 4, range_ratio=0.5, vocab_size=512, seed=0)
    assert res["num_requests"] == 3 and res["total_output_tokens"] == sum(r.output_len for r in want)
    assert res["total_input_tokens"] == sum(r.prompt_len for r in want)
    assert res["requests_per_second"] > 0 and res["config"]["dtype"] == "float32"
    assert png_size(tmp_path / "t-throughput.png")[0] > 500
    assert "Throughput:" in capsys.readouterr().out


def test_latency(llama_ckpt, tmp_path, capsys):
    rc = main(["bench", "latency", "--model", llama_ckpt, "--input-len", "6", "--output-len", "3", "--batch-size", "2",
               "--num-iters-warmup", "1", "--num-iters", "3", "--result-dir", str(tmp_path), "--result-filename",
               "l.json", "--plot", *ENGINE])
    assert rc == 0
    res = json.loads((tmp_path / "l.json").read_text())
    assert res["kind"] == "latency" and len(res["latencies"]) == 3 and res["batch_size"] == 2
    assert min(res["latencies"]) <= res["percentiles"]["50"] <= max(res["latencies"])
    assert png_size(tmp_path / "l-latency.png")[0] > 500
    assert "Avg latency:" in capsys.readouterr().out
    assert main(["bench", "latency", "--model", llama_ckpt, "--num-iters", "0", "--result-dir", str(tmp_path)]) == 2
