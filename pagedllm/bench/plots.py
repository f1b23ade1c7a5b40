"""PNG charts of benchmark results (matplotlib, the ``pagedllm[bench]`` extra).

- distributions: TTFT, TPOT and ITL histograms of one or more runs overlaid (median and p99
  marked when there is one run);
- sweep: throughput and latency against request rate, one line per result file;
- latency: the distribution of ``bench latency``'s batch latencies.
"""
from __future__ import annotations

import math
import os
from typing import Sequence

MISSING = ("--plot draws charts with matplotlib, which is not installed: pip install 'pagedllm[bench]' "
           "(or pip install matplotlib)")


class PlotUnavailable(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _values(run: dict, key: str) -> list[float]:
    """Per-request values in ms (itls flattened); failed requests (None) left out."""
    xs = run.get(key) or []
    if key == "itls":
        xs = [x for per_request in xs for x in (per_request or [])]
    return [x * 1000 for x in xs if x is not None]


def _rate_label(rate) -> str:
    if rate in ("inf", None) or (isinstance(rate, float) and math.isinf(rate)):
        return "inf"
    return f"{float(rate):g}"


def _rate_key(label: str) -> float:
    return math.inf if label == "inf" else float(label)


def run_label(label: str, run: dict, many_runs: bool) -> str:
    return f"{label} @ {_rate_label(run.get('request_rate'))}/s" if many_runs else label


def plot_distributions(series: Sequence[tuple[str, Sequence[dict]]], path: str) -> str:
    """TTFT / TPOT / ITL histograms; ``series``: (label, runs) per result file."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    entries = [(run_label(label, run, len(runs) > 1), run) for label, runs in series for run in runs]
    for ax, (key, title) in zip(axes, (("ttfts", "Time to first token"), ("tpots", "Time per output token"),
                                       ("itls", "Inter-token latency"))):
        for name, run in entries:
            xs = _values(run, key)
            if not xs:
                continue
            ax.hist(xs, bins=min(50, max(5, len(xs) // 4)), histtype="step" if len(entries) > 1 else "bar",
                    alpha=0.85 if len(entries) > 1 else 0.7, linewidth=1.6, label=name)
            if len(entries) == 1:
                s = sorted(xs)
                for p, style in ((50, "--"), (99, ":")):
                    v = s[min(len(s) - 1, int(round((len(s) - 1) * p / 100)))]
                    ax.axvline(v, color="black", linestyle=style, linewidth=1.2, label=f"p{p} {v:.1f} ms")
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Request latency distributions")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_sweep(series: Sequence[tuple[str, Sequence[dict]]], path: str) -> str:
    """Throughput and latency against request rate (one line per file; inf at the right end)."""
    plt = _pyplot()
    labels = sorted({_rate_label(r.get("request_rate")) for _, runs in series for r in runs}, key=_rate_key)
    pos = {lab: i for i, lab in enumerate(labels)}
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(13, 4.6))
    for name, runs in series:
        runs = sorted(runs, key=lambda r: _rate_key(_rate_label(r.get("request_rate"))))
        xs = [pos[_rate_label(r.get("request_rate"))] for r in runs]
        ax_t.plot(xs, [r["output_throughput"] for r in runs], marker="o", label=f"{name}: output tok/s")
        for metric, style in (("ttft", "-"), ("tpot", "--"), ("e2el", ":")):
            for stat in ("median", "p99"):
                key = f"{stat}_{metric}_ms"
                if all(key in r for r in runs):
                    ax_l.plot(xs, [r[key] for r in runs], marker="o" if stat == "median" else "^", linestyle=style,
                              label=f"{name}: {stat} {metric.upper()}")
    for ax in (ax_t, ax_l):
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_t.set_ylabel("output tokens / s")
    ax_t.set_title("Throughput vs request rate")
    ax_l.set_ylabel("ms")
    ax_l.set_yscale("log")
    ax_l.set_title("Latency vs request rate")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_latency(series: Sequence[tuple[str, dict]], path: str) -> str:
    """``bench latency``: the batch latencies of one or more results."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, result in series:
        xs = [x * 1000 for x in result.get("latencies", [])]
        if xs:
            ax.hist(xs, bins=min(30, max(5, len(xs) // 2)), histtype="step" if len(series) > 1 else "bar",
                    linewidth=1.6, alpha=0.8, label=f"{name}: avg {result['avg_latency'] * 1000:.1f} ms")
    ax.set_xlabel("batch latency (ms)")
    ax.set_ylabel("iterations")
    ax.set_title("End-to-end batch latency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_throughput(series: Sequence[tuple[str, dict]], path: str) -> str:
    """``bench throughput``: bars of requests/s and output tokens/s per result."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [n for n, _ in series]
    for ax, key, title in zip(axes, ("requests_per_second", "output_tokens_per_second"),
                              ("requests / s", "output tokens / s")):
        vals = [r[key] for _, r in series]
        bars = ax.bar(range(len(vals)), vals, color=[f"C{i}" for i in range(len(vals))])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_xticks(range(len(vals)), names, rotation=15, fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig, plt, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
