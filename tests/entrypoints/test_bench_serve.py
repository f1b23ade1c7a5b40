"""`pagedllm bench serve` against the live test server: a rate sweep with charts, the chat
backend, a sharegpt file and prefix repetition, and clear errors for bad flags / no server."""
from __future__ import annotations

import json

import pytest

from pagedllm.bench.datasets import random_requests
from pagedllm.entrypoints.cli import main

from conftest import free_port

from png_files import png_size


def bench(server, tmp_path, *flags: str) -> dict:
    rc = main(["bench", "serve", "--base-url", server.url, "--disable-tqdm", "--result-dir", str(tmp_path),
               "--result-filename", "r.json", *flags])
    assert rc == 0
    return json.loads((tmp_path / "r.json").read_text())


def test_sweep_writes_json_and_charts(server, tmp_path):
    res = bench(server, tmp_path, "--num-prompts", "5", "--input-len", "10", "--output-len", "4",
                "--random-range-ratio", "0.5", "--random-vocab-size", "500", "--ignore-eos", "--request-rate",
                "25,inf", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90", "--plot")
    assert res["command"].startswith("pagedllm bench serve --base-url")
    assert res["machine"]["cpu_flags"] == sorted(res["machine"]["cpu_flags"]) and "gpus" in res["machine"]
    assert res["model_id"] == "tiny" and res["config"]["backend"] == "openai"
    want = random_requests(5, 10, 4, range_ratio=0.5, vocab_size=500, seed=0)
    assert [r["request_rate"] for r in res["runs"]] == [25.0, "inf"]
    for run in res["runs"]:
        assert run["completed"] == 5 and run["failed"] == 0
        assert run["output_lens"] == [r.output_len for r in want]  # ignore_eos: exactly what was asked
        assert run["input_lens"] == [r.prompt_len for r in want]  # the server's usage agrees
        assert run["total_output_tokens"] == sum(r.output_len for r in want)
        assert all(t > 0 for t in run["ttfts"]) and all(len(i) <= n - 1 for i, n in zip(run["itls"], run["output_lens"]))
        assert run["p90_e2el_ms"] >= run["median_e2el_ms"] > 0
    for suffix in ("-distributions.png", "-vs-rate.png"):
        w, h = png_size(tmp_path / ("r" + suffix))
        assert w > 1000 and h > 300
    # and compare draws the two files overlaid
    (tmp_path / "r2.json").write_text((tmp_path / "r.json").read_text())
    assert main(["bench", "compare", str(tmp_path / "r.json"), str(tmp_path / "r2.json"), "--plot",
                 "--result-dir", str(tmp_path)]) == 0
    assert png_size(tmp_path / "compare-r-vs-r2-distributions.png")[0] > 1000
    assert png_size(tmp_path / "compare-r-vs-r2-vs-rate.png")[0] > 1000


def test_chat_backend_and_concurrency_cap(server, tmp_path, llama_ckpt):
    res = bench(server, tmp_path, "--backend", "openai-chat", "--tokenizer", llama_ckpt, "--num-prompts", "3",
                "--input-len", "6", "--output-len", "3", "--ignore-eos", "--max-concurrency", "1")
    run = res["runs"][0]
    assert run["completed"] == 3 and run["failed"] == 0 and run["output_lens"] == [3, 3, 3]
    assert run["max_concurrency"] == 1
    # one at a time: each request is sent after the previous one's stream ended
    spans = sorted(zip(run["start_times"], run["e2els"]))
    assert all(s0 + e0 <= s1 for (s0, e0), (s1, _) in zip(spans, spans[1:])), spans
    assert res["config"]["backend"] == "openai-chat"


def test_sharegpt_and_prefix_repetition(server, tmp_path, llama_ckpt):
    data = [{"conversations": [{"from": "human", "value": "w5 w6 w7"}, {"from": "gpt", "value": "w8 w9"}]}] * 3
    (tmp_path / "sg.json").write_text(json.dumps(data))
    run = bench(server, tmp_path, "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sg.json"),
                "--tokenizer", llama_ckpt, "--num-prompts", "3", "--ignore-eos")["runs"][0]
    assert run["completed"] == 3 and set(run["output_lens"]) == {2}
    run = bench(server, tmp_path, "--dataset-name", "prefix-repetition", "--prefix-repetition-prefix-len", "16",
                "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "2",
                "--prefix-repetition-output-len", "2", "--num-prompts", "4", "--random-vocab-size", "500",
                "--ignore-eos")["runs"][0]
    assert run["completed"] == 4 and run["input_lens"] == [20] * 4 and run["output_lens"] == [2] * 4


@pytest.mark.parametrize("flags, message", [
    (["--percentile-metrics", "ttft,bogus"], "percentile_metrics"),
    (["--request-rate", "0"], "request_rate"),
    (["--max-concurrency", "0"], "max_concurrency"),
    (["--dataset-name", "sharegpt"], "--dataset-path"),
])
def test_bad_flags(server, tmp_path, capsys, flags, message):
    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "1", "--result-dir", str(tmp_path), *flags])
    assert rc == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no result file for a run that did not happen


def test_no_server_is_a_clear_error(tmp_path, capsys):
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1",
               "--result-dir", str(tmp_path)])
    assert rc == 2 and "cannot reach" in capsys.readouterr().err
