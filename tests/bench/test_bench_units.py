"""pagedllm.bench without a server: workloads, the summary arithmetic, arrival times, result
files (ours and vLLM's), the compare table, and the charts drawn for real (matplotlib)."""
from __future__ import annotations

import json
import math
import sys

import pytest

from pagedllm.bench import datasets, metrics, serve
from pagedllm.bench.compare import compare_table
from pagedllm.bench.results import load_result
from png_files import png_size


def test_random_lengths_within_ratio_and_seeded():
    reqs = datasets.random_requests(200, 100, 20, range_ratio=0.5, prefix_len=7, vocab_size=50, seed=3)
    assert all(57 <= r.prompt_len <= 157 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(10 <= r.output_len <= 30 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 20  # spread, not one length
    assert all(3 <= t < 50 for r in reqs for t in r.prompt)
    assert len({tuple(r.prompt[:7]) for r in reqs}) == 1  # the shared prefix
    again = datasets.random_requests(200, 100, 20, range_ratio=0.5, prefix_len=7, vocab_size=50, seed=3)
    assert again == reqs
    fixed = datasets.random_requests(5, 9, 4, vocab_size=50)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(9, 4)}
    with pytest.raises(ValueError, match="random_range_ratio"):
        datasets.random_requests(1, 9, 4, range_ratio=1.0)
    with pytest.raises(ValueError, match="input_len"):
        datasets.random_requests(1, 0, 4)


def test_prefix_repetition_shares_prefixes():
    reqs = datasets.prefix_repetition_requests(30, 12, 5, 3, 7, vocab_size=100, seed=1)
    assert len(reqs) == 30 and all(r.prompt_len == 17 == len(r.prompt) and r.output_len == 7 for r in reqs)
    prefixes = [tuple(r.prompt[:12]) for r in reqs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 10 for p in set(prefixes))
    assert len({tuple(r.prompt) for r in reqs}) == 30  # suffixes differ
    with pytest.raises(ValueError, match="prefix_repetition_num_prefixes"):
        datasets.prefix_repetition_requests(3, 12, 5, 0, 7)


def test_sharegpt_file(tmp_path, llama_ckpt):
    data = [{"conversations": [{"from": "human", "value": "w1 w2 w3"}, {"from": "gpt", "value": "w4 w5"}]},
            {"conversations": [{"from": "human", "value": "only one turn"}]},
            {"conversations": [{"from": "human", "value": "w7 w8"}, {"from": "gpt", "value": "w9 w10 w11 w12"}]},
            "not a conversation"]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    tok = datasets.load_tokenizer(llama_ckpt)
    reqs = datasets.sharegpt_requests(str(path), 4, tokenizer=tok, seed=0)
    assert len(reqs) == 4
    by_prompt = {r.prompt: r for r in reqs}
    assert set(by_prompt) == {"w1 w2 w3", "w7 w8"}
    assert by_prompt["w1 w2 w3"].output_len == len(tok("w4 w5").input_ids)
    assert by_prompt["w7 w8"].prompt_len == len(tok("w7 w8").input_ids)
    fixed = datasets.sharegpt_requests(str(path), 2, output_len=9)
    assert all(r.output_len == 9 and r.prompt_len is None for r in fixed)
    with pytest.raises(ValueError, match="--tokenizer"):
        datasets.sharegpt_requests(str(path), 2)
    with pytest.raises(ValueError, match="--dataset-path"):
        datasets.sharegpt_requests("", 2, output_len=3)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        datasets.sharegpt_requests(str(tmp_path / "bad.json"), 2, output_len=3)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="no conversation"):
        datasets.sharegpt_requests(str(tmp_path / "empty.json"), 2, output_len=3)


def test_chat_text_without_tokenizer():
    req = datasets.SampleRequest([3, 4, 5], 3, 2)
    text = datasets.as_text(req, None, 0)
    assert isinstance(text.prompt, str) and len(text.prompt.split()) == 3 and text.prompt_len is None


def result(ttft, latency, out, itl, prompt=10):
    return metrics.RequestResult(prompt, out, True, "", ttft, latency, list(itl))


def test_summary_arithmetic():
    rs = [result(0.1, 1.1, 11, [0.1] * 10), result(0.3, 2.3, 5, [0.5] * 4),
          metrics.RequestResult(10, 0, False, "HTTP 500: boom")]
    s = metrics.summarize(rs, 2.0, ["ttft", "tpot", "itl", "e2el"], [50, 99])
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 500: boom"]
    assert s["total_output_tokens"] == 16 and s["total_input_tokens"] == 20
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 8.0 and s["total_token_throughput"] == 18.0
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["p99_ttft_ms"] == pytest.approx(100 + 200 * 0.99)
    assert s["mean_tpot_ms"] == pytest.approx((100 + 500) / 2)  # (1.1-0.1)/10 and (2.3-0.3)/4
    assert s["median_itl_ms"] == pytest.approx(100)  # ten 0.1 gaps, four 0.5 gaps
    assert s["mean_e2el_ms"] == pytest.approx(1700)
    assert s["ttfts"] == [0.1, 0.3, None] and s["itls"][2] == []
    only = metrics.summarize(rs, 2.0, ["ttft"], [99])
    assert "mean_tpot_ms" not in only and "p99_ttft_ms" in only
    report = metrics.format_report(s, ["ttft", "tpot", "itl", "e2el"], [50, 99], "T")
    assert "Successful requests:" in report and "P99 TTFT (ms):" in report and "boom" in report
    with pytest.raises(ValueError, match="percentile_metrics"):
        metrics.parse_metric_names("ttft,latency")
    with pytest.raises(ValueError, match="metric_percentiles"):
        metrics.parse_percentiles("0,50")
    assert metrics.parse_percentiles("50,99.9") == [50.0, 99.9]


def test_request_rates_and_arrivals():
    assert serve.parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "fast", ""):
        with pytest.raises(ValueError, match="request_rate"):
            serve.parse_rates(bad)
    gaps = serve.arrival_gaps(4000, 8.0, 1.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8, rel=0.05)
    bursty = serve.arrival_gaps(4000, 8.0, 0.25, seed=0)
    assert sum(bursty) / len(bursty) == pytest.approx(1 / 8, rel=0.1)
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert var(bursty) > 2 * var(gaps)  # gamma shape 0.25: four times the Poisson variance
    assert serve.arrival_gaps(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_request_bodies():
    req = datasets.SampleRequest([5, 6], 2, 3)
    body = serve.request_body("openai", req, "m", ignore_eos=True, temperature=0.0, extra_body={"top_k": 1})
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 3 and body["ignore_eos"] and body["top_k"] == 1
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    chat = serve.request_body("openai-chat", datasets.SampleRequest("hi", None, 3), None, ignore_eos=False,
                              temperature=0.5, extra_body=None)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat and "model" not in chat
    # a chat stream's first chunk carries only the role: no content, no TTFT
    assert serve._chunk_text("openai-chat", {"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert serve._chunk_text("openai-chat", {"choices": [{"delta": {"content": "x"}}]}) == "x"
    assert serve._chunk_text("openai", {"choices": [{"text": "y"}]}) == "y"


def serve_file(tmp_path, name, scale=1.0, rates=(1.0, math.inf)):
    from pagedllm.bench.results import write_result

    runs = []
    for i, rate in enumerate(rates):
        rs = [result(0.05 * scale * (j + 1) * (i + 1), 0.5 * scale * (j + 1), 6, [0.02 * scale * (k + 1) for k in range(5)])
              for j in range(12)]
        runs.append({"request_rate": rate, **metrics.summarize(rs, 3.0 / scale, list(metrics.METRICS), [50, 99])})
    return write_result(str(tmp_path / f"{name}.json"), "serve", ["bench", "serve", "--x"], {"a": 1},
                        {"model_id": "m", "runs": runs}, [1.0, 1.0, 1.0])


def test_result_files_compare_and_charts(tmp_path):
    from pagedllm.bench import plots

    a, b = serve_file(tmp_path, "a"), serve_file(tmp_path, "b", scale=2.0)
    ra = load_result(a)
    data = json.loads(open(a).read())
    assert data["command"] == "pagedllm bench serve --x" and "cpu_flags" in data["machine"]
    assert ra.kind == "serve" and len(ra.runs) == 2 and ra.runs[1]["request_rate"] == "inf"  # JSON without inf
    table = compare_table([ra, load_result(b)])
    assert "a @1/s" in table and "b @inf/s" in table and "median TTFT (ms)" in table
    # a vLLM `bench serve --save-result` file (one flat run) loads as a serving result
    vllm = tmp_path / "vllm.json"
    vllm.write_text(json.dumps({**{k: v for k, v in ra.runs[0].items()}, "request_rate": 1.0}))
    assert load_result(str(vllm)).kind == "serve"
    (tmp_path / "junk.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match="not a pagedllm or vLLM benchmark result"):
        load_result(str(tmp_path / "junk.json"))

    dist = plots.plot_distributions([("a", ra.runs), ("b", load_result(b).runs)], str(tmp_path / "d.png"))
    sweep = plots.plot_sweep([("a", ra.runs), ("b", load_result(b).runs)], str(tmp_path / "s.png"))
    w, h = png_size(dist)
    assert w > 1000 and h > 300
    assert png_size(sweep)[0] > 1000
    # the charts have drawn data: far from one flat colour
    import matplotlib.image

    img = matplotlib.image.imread(sweep)
    assert img[..., :3].std() > 0.05


def test_missing_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    from pagedllm.bench import plots
    from pagedllm.entrypoints.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(plots.PlotUnavailable, match=r"pagedllm\[bench\]"):
        plots.plot_sweep([], str(tmp_path / "x.png"))
    a = serve_file(tmp_path, "a")
    assert main(["bench", "compare", a, a, "--plot", "--result-dir", str(tmp_path)]) == 2


def test_compare_refuses_mixed_kinds(tmp_path, capsys):
    from pagedllm.bench.results import write_result
    from pagedllm.entrypoints.cli import main

    a = serve_file(tmp_path, "a")
    t = write_result(str(tmp_path / "t.json"), "throughput", [], {}, {"requests_per_second": 1.0,
                                                                     "output_tokens_per_second": 2.0}, None)
    assert main(["bench", "compare", a, t]) == 2
    assert "cannot compare different kinds" in capsys.readouterr().err
    assert main(["bench", "compare", a, a, "--labels", "one"]) == 2
