"""``pagedllm bench {serve, throughput, latency, compare}``: flags (vLLM's names where vLLM has
the flag) and the runs. The ``pagedllm`` CLI adds the engine flags to the offline kinds and
hands in how to build the engine from them."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, Callable, Optional, Sequence

from pagedllm import envs
from pagedllm.bench.datasets import DATASETS

KINDS = ("serve", "throughput", "latency", "compare")


def _add_dataset_args(p: argparse.ArgumentParser, *, input_len: int, num_prompts: int) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="random token ids, a ShareGPT-style JSON file (--dataset-path), or shared prefixes "
                        "with random suffixes")
    g.add_argument("--dataset-path", default=None, help="the sharegpt dataset's JSON file")
    g.add_argument("--num-prompts", type=int, default=num_prompts, help=f"requests (default {num_prompts})")
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=input_len,
                   help=f"random: prompt tokens (default {input_len})")
    g.add_argument("--output-len", "--random-output-len", "--sharegpt-output-len", dest="output_len", type=int,
                   default=None, help="output tokens per request (default 128; sharegpt: the reply's length)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths drawn uniformly in [len*(1-r), len*(1+r)] (default 0: fixed)")
    g.add_argument("--random-prefix-len", type=int, default=0, help="random: tokens of one prefix shared by all")
    g.add_argument("--random-vocab-size", type=int, default=None,
                   help="random prompt ids are drawn in [3, this) (default: the tokenizer's size, else 1000)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--seed", type=int, default=0, help="workload (and engine) seed")


def _add_result_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("results")
    g.add_argument("--result-dir", default=".", help="where the JSON result (and charts) go (default: .)")
    g.add_argument("--result-filename", default=None,
                   help="the JSON file's name (default: KIND[-BACKEND]-MODEL-YYYYmmdd-HHMMSS.json)")
    g.add_argument("--save-result", action="store_true",
                   help="accepted for vLLM command lines: every run writes its JSON result")
    g.add_argument("--plot", action="store_true", help="also draw PNG charts next to the JSON (pagedllm[bench])")


def add_bench_parser(sub, add_engine_args: Callable[..., None]) -> None:
    """``pagedllm bench`` under the CLI's subparsers; ``add_engine_args(parser, exclude=...)``
    adds the engine flags (the offline kinds run an engine here)."""
    bench = sub.add_parser("bench", help="benchmark: serve (an OpenAI-compatible server), throughput, latency, "
                                         "compare (result files side by side)")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="{serve,throughput,latency,compare}")

    srv = kinds.add_parser("serve", help="drive an OpenAI-compatible server and measure TTFT/TPOT/ITL/throughput")
    srv.add_argument("--backend", default="openai", choices=["openai", "openai-chat"],
                     help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    srv.add_argument("--base-url", default=None, help="the server (default http://HOST:PORT)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--endpoint", default=None, help="path under the base URL (default: the backend's)")
    srv.add_argument("--model", default=None, help="model name sent (default: the first of GET /v1/models)")
    srv.add_argument("--tokenizer", default=None,
                     help="a local tokenizer directory: sharegpt lengths, random ids' range, chat prompts' text")
    srv.add_argument("--api-key", default=None, help="bearer token (env OPENAI_API_KEY or PAGEDLLM_API_KEY)")
    srv.add_argument("--request-rate", default="inf",
                     help="requests/s, Poisson arrivals; inf: all at once; a list 1,2,4,8,inf sweeps (default inf)")
    srv.add_argument("--burstiness", type=float, default=1.0,
                     help="gamma shape of the arrival intervals: 1 Poisson, < 1 burstier, > 1 steadier")
    srv.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    srv.add_argument("--ignore-eos", action="store_true",
                     help="send ignore_eos (a vLLM/pagedllm field) so every request generates --output-len tokens")
    srv.add_argument("--temperature", type=float, default=0.0)
    srv.add_argument("--extra-body", type=json.loads, default=None, help="JSON object merged into each request body")
    srv.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                     help="which of ttft,tpot,itl,e2el to report (default ttft,tpot,itl)")
    srv.add_argument("--metric-percentiles", default="99", help="percentiles reported, e.g. 50,90,99 (default 99)")
    srv.add_argument("--request-timeout", type=float, default=None, help="seconds per request (default: none)")
    srv.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    _add_dataset_args(srv, input_len=1024, num_prompts=1000)
    _add_result_args(srv)

    thr = kinds.add_parser("throughput", help="offline: the whole workload through LLM.generate at once")
    thr.add_argument("--model", default=None, help="model directory (default: the embedded tiny-shakespeare)")
    thr.add_argument("--n", type=int, default=1, help="sequences per prompt")
    thr.add_argument("--temperature", type=float, default=0.0)
    _add_dataset_args(thr, input_len=1024, num_prompts=1000)
    _add_result_args(thr)
    add_engine_args(thr, exclude=("seed",))

    lat = kinds.add_parser("latency", help="offline: the latency of one batch, repeated")
    lat.add_argument("--model", default=None, help="model directory (default: the embedded tiny-shakespeare)")
    lat.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    lat.add_argument("--output-len", type=int, default=128, help="output tokens (default 128)")
    lat.add_argument("--batch-size", type=int, default=8, help="prompts in the batch (default 8)")
    lat.add_argument("--n", type=int, default=1, help="sequences per prompt")
    lat.add_argument("--temperature", type=float, default=0.0)
    lat.add_argument("--num-iters-warmup", type=int, default=10)
    lat.add_argument("--num-iters", type=int, default=30)
    lat.add_argument("--random-vocab-size", type=int, default=None)
    lat.add_argument("--seed", type=int, default=0)
    _add_result_args(lat)
    add_engine_args(lat, exclude=("seed",))

    cmp_ = kinds.add_parser("compare", help="result files side by side (and overlaid charts with --plot)")
    cmp_.add_argument("results", nargs="+", metavar="RESULT.json")
    cmp_.add_argument("--labels", default=None, help="comma-separated names for the files (default: file stems)")
    cmp_.add_argument("--plot", action="store_true", help="overlay the files' charts (pagedllm[bench])")
    cmp_.add_argument("--result-dir", default=".", help="where the charts go (default: .)")


def _config_of(args, skip: Sequence[str] = ()) -> dict:
    return {k: v for k, v in sorted(vars(args).items())
            if k not in ("command", "bench_kind", "api_key", "stop_requested", *skip) and not callable(v)}


def _plot(fn, *a) -> Optional[str]:
    from pagedllm.bench.plots import PlotUnavailable

    try:
        return fn(*a)
    except PlotUnavailable as e:
        raise ValueError(str(e)) from None


def _serve(args, argv) -> int:
    from pagedllm.bench.datasets import load_tokenizer, sample_requests
    from pagedllm.bench.metrics import format_report, parse_metric_names, parse_percentiles, summarize
    from pagedllm.bench.results import result_path, write_result
    from pagedllm.bench.serve import benchmark, parse_rates

    metrics = parse_metric_names(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    rates = parse_rates(args.request_rate)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {args.max_concurrency}")
    if args.plot:
        from pagedllm.bench.plots import _pyplot

        _plot(_pyplot)  # fail before the run, not after it
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    args.api_key = args.api_key or envs.openai_api_key() or envs.api_key()
    tokenizer = load_tokenizer(args.tokenizer)
    reqs = sample_requests(args, tokenizer)
    before = _load_average()
    model, passes = asyncio.run(benchmark(args, reqs, rates, tokenizer))
    runs = []
    for rate, results, duration in passes:
        s = {"request_rate": rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
             **summarize(results, duration, metrics, percentiles)}
        print(format_report(s, metrics, percentiles, f"Serving Benchmark Result (rate {rate:g}/s)"))
        runs.append(s)
    path = result_path(args, "serve", model)
    write_result(path, "serve", argv, {**_config_of(args), "model": model}, {"model_id": model, "runs": runs}, before)
    print(f"result: {path}")
    if args.plot:
        from pagedllm.bench.plots import plot_distributions, plot_sweep

        stem = os.path.splitext(path)[0]
        label = model
        print("chart:", _plot(plot_distributions, [(label, runs)], stem + "-distributions.png"))
        if len(runs) > 1:
            print("chart:", _plot(plot_sweep, [(label, runs)], stem + "-vs-rate.png"))
    failed = sum(r["failed"] for r in runs)
    return 1 if failed and not any(r["completed"] for r in runs) else 0


def _load_average():
    from pagedllm.bench.environment import load_average

    return load_average()


def _offline(kind: str, args, argv, make_llm) -> int:
    from pagedllm.bench import offline
    from pagedllm.bench.results import result_path, write_result

    if args.n < 1:
        raise ValueError(f"n must be >= 1, got {args.n}")
    if args.plot:
        from pagedllm.bench.plots import _pyplot

        _plot(_pyplot)
    before = _load_average()
    model = offline.llm_model(args)
    if kind == "throughput":
        s = offline.run_throughput(args, make_llm)
        print(offline.throughput_report(s))
    else:
        s = offline.run_latency(args, make_llm)
        print(offline.latency_report(s))
    path = result_path(args, kind, model)
    write_result(path, kind, argv, {**_config_of(args), "model": model}, s, before)
    print(f"result: {path}")
    if args.plot:
        from pagedllm.bench.plots import plot_latency, plot_throughput

        stem = os.path.splitext(path)[0]
        name = os.path.basename(model.rstrip("/"))
        if kind == "latency":
            print("chart:", _plot(plot_latency, [(name, s)], stem + "-latency.png"))
        else:
            print("chart:", _plot(plot_throughput, [(name, s)], stem + "-throughput.png"))
    return 0


def _compare(args) -> int:
    from pagedllm.bench.compare import compare_table
    from pagedllm.bench.results import load_result

    labels = [x.strip() for x in args.labels.split(",")] if args.labels else [None] * len(args.results)
    if len(labels) != len(args.results):
        raise ValueError(f"labels: {len(labels)} names for {len(args.results)} result files")
    loaded = [load_result(p, lab) for p, lab in zip(args.results, labels)]
    kinds = {r.kind for r in loaded}
    if len(kinds) > 1:
        raise ValueError(f"results: cannot compare different kinds ({', '.join(sorted(kinds))})")
    print(compare_table(loaded))
    if args.plot:
        from pagedllm.bench import plots

        stem = os.path.join(args.result_dir, "compare-" + "-vs-".join(r.label for r in loaded)[:120])
        kind = loaded[0].kind
        if kind == "serve":
            series = [(r.label, r.runs) for r in loaded]
            print("chart:", _plot(plots.plot_distributions, series, stem + "-distributions.png"))
            if any(len(r.runs) > 1 for r in loaded):
                print("chart:", _plot(plots.plot_sweep, series, stem + "-vs-rate.png"))
        elif kind == "latency":
            print("chart:", _plot(plots.plot_latency, [(r.label, r.runs[0]) for r in loaded], stem + "-latency.png"))
        else:
            print("chart:", _plot(plots.plot_throughput, [(r.label, r.runs[0]) for r in loaded],
                                  stem + "-throughput.png"))
    return 0


def run_bench(args, argv: Optional[Sequence[str]], make_llm: Callable[[Any], Any], parser) -> int:
    """Run the parsed ``pagedllm bench KIND``; a bad flag value is one line on stderr, exit 2."""
    if args.bench_kind is None:
        parser.print_help()
        return 2
    try:
        if args.bench_kind == "serve":
            return _serve(args, argv)
        if args.bench_kind == "compare":
            return _compare(args)
        return _offline(args.bench_kind, args, argv, make_llm)
    except ValueError as e:
        print(f"pagedllm bench {args.bench_kind}: error: {e}", file=sys.stderr)
        return 2
