"""``pagedllm bench compare``: result files as one table, a column per file (and per request
rate for serving results), and the ratio of each file to the first."""
from __future__ import annotations

import math
from typing import Sequence

from pagedllm.bench.results import LoadedResult

SERVE_ROWS = [("completed", "requests completed"), ("failed", "requests failed"), ("duration", "duration (s)"),
              ("request_throughput", "requests/s"), ("output_throughput", "output tok/s"),
              ("total_token_throughput", "total tok/s"), ("mean_ttft_ms", "mean TTFT (ms)"),
              ("median_ttft_ms", "median TTFT (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)"),
              ("mean_tpot_ms", "mean TPOT (ms)"), ("median_tpot_ms", "median TPOT (ms)"),
              ("p99_tpot_ms", "p99 TPOT (ms)"), ("mean_itl_ms", "mean ITL (ms)"), ("median_itl_ms", "median ITL (ms)"),
              ("p99_itl_ms", "p99 ITL (ms)"), ("mean_e2el_ms", "mean E2EL (ms)"), ("p99_e2el_ms", "p99 E2EL (ms)")]
THROUGHPUT_ROWS = [("num_requests", "requests"), ("elapsed_time", "elapsed (s)"),
                   ("requests_per_second", "requests/s"), ("tokens_per_second", "total tok/s"),
                   ("output_tokens_per_second", "output tok/s")]
LATENCY_ROWS = [("batch_size", "batch size"), ("input_len", "input len"), ("output_len", "output len"),
                ("avg_latency", "avg latency (s)")]


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _rate(run: dict) -> str:
    r = run.get("request_rate")
    return "inf" if r in (None, "inf") or (isinstance(r, float) and math.isinf(r)) else f"{float(r):g}"


def compare_table(results: Sequence[LoadedResult]) -> str:
    kind = results[0].kind
    columns: list[tuple[str, dict]] = []
    if kind == "serve":
        rates = sorted({_rate(run) for r in results for run in r.runs}, key=lambda x: math.inf if x == "inf" else float(x))
        for rate in rates:
            for r in results:
                for run in r.runs:
                    if _rate(run) == rate:
                        columns.append((f"{r.label} @{rate}/s", run))
        rows = SERVE_ROWS
    else:
        columns = [(r.label, r.runs[0]) for r in results]
        rows = THROUGHPUT_ROWS if kind == "throughput" else LATENCY_ROWS
        if kind == "latency":
            ps = sorted({p for _, run in columns for p in run.get("percentiles", {})}, key=float)
            for _, run in columns:
                for p in ps:
                    run.setdefault(f"p{p}", run.get("percentiles", {}).get(p))
            rows = rows + [(f"p{p}", f"p{p} latency (s)") for p in ps]
    present = [(k, name) for k, name in rows if any(k in run for _, run in columns)]
    header = ["metric"] + [c for c, _ in columns]
    table = [header] + [[name] + [_fmt(run.get(k)) for _, run in columns] for k, name in present]
    if len(results) == 2 and kind != "serve":  # second / first
        table[0].append(f"{results[1].label} / {results[0].label}")
        for row, (k, _) in zip(table[1:], present):
            a, b = columns[0][1].get(k), columns[1][1].get(k)
            ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and a
            row.append(f"{b / a:.2f}x" if ok else "-")
    widths = [max(len(row[i]) for row in table) for i in range(len(header) + (len(table[0]) - len(header)))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table)
