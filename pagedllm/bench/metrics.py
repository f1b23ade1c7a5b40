"""Per-request measurements and their summary, under vLLM's result-file names (``ttfts``,
``itls``, ``mean_ttft_ms``, ``p99_tpot_ms`` ...), so result files of either compare."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

# --percentile-metrics names -> (label, how a request's values are read)
METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestResult:
    """One request as the client saw it: times in seconds from sending it."""
    prompt_len: Optional[int]  # tokens (the server's usage when it sends one)
    output_len: int = 0  # tokens generated
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # to the first chunk carrying content
    latency: float = 0.0  # to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    start: float = 0.0  # when it was sent (after waiting for --max-concurrency), seconds into the run

    @property
    def tpot(self) -> Optional[float]:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def parse_metric_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise ValueError(f"percentile_metrics: {', '.join(bad) or repr(text)} not among {', '.join(METRICS)}")
    return names


def parse_percentiles(text: str) -> list[float]:
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"metric_percentiles must be numbers separated by commas, got {text!r}") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise ValueError(f"metric_percentiles must be in (0, 100], got {text!r}")
    return ps


def percentile(sorted_xs: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_xs:
        return math.nan
    k = (len(sorted_xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


def pct_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_") if p != int(p) else f"p{int(p)}"


def metric_values(results: Sequence[RequestResult], name: str) -> list[float]:
    ok = [r for r in results if r.ok]
    if name == "ttft":
        return [r.ttft for r in ok]
    if name == "tpot":
        return [r.tpot for r in ok if r.tpot is not None]
    if name == "itl":
        return [x for r in ok for x in r.itl]
    return [r.latency for r in ok]


def summarize(results: Sequence[RequestResult], duration: float, metrics: Sequence[str],
              percentiles: Sequence[float]) -> dict:
    """The run's figures: throughputs, then mean/median/std/percentiles in ms of each metric, then
    the per-request lists the charts are drawn from."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len or 0 for r in ok)
    s = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
         "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         "request_throughput": len(ok) / duration if duration > 0 else math.nan,
         "output_throughput": out_tokens / duration if duration > 0 else math.nan,
         "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else math.nan,
         "errors": sorted({r.error for r in results if not r.ok})[:10]}
    for name in METRICS:
        xs = sorted(metric_values(results, name))
        if name not in metrics:
            continue
        s[f"mean_{name}_ms"] = statistics.fmean(xs) * 1000 if xs else math.nan
        s[f"median_{name}_ms"] = percentile(xs, 50) * 1000
        s[f"std_{name}_ms"] = statistics.pstdev(xs) * 1000 if xs else math.nan
        for p in percentiles:
            s[f"{pct_key(p)}_{name}_ms"] = percentile(xs, p) * 1000
    s["input_lens"] = [r.prompt_len for r in results]
    s["output_lens"] = [r.output_len for r in results]
    s["ttfts"] = [r.ttft if r.ok else None for r in results]
    s["tpots"] = [r.tpot if r.ok else None for r in results]
    s["itls"] = [r.itl if r.ok else [] for r in results]
    s["e2els"] = [r.latency if r.ok else None for r in results]
    s["start_times"] = [r.start for r in results]
    return s


def format_report(s: dict, metrics: Sequence[str], percentiles: Sequence[float], title: str) -> str:
    """The run as vLLM prints it: a boxed table of totals, throughputs and latencies."""
    width = 50
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label, value, fmt="{:.2f}"):
        text = "nan" if isinstance(value, float) and math.isnan(value) else fmt.format(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", s["completed"], "{}")
    row("Failed requests:", s["failed"], "{}")
    if s.get("max_concurrency"):
        row("Maximum request concurrency:", s["max_concurrency"], "{}")
    if "request_rate" in s:
        row("Request rate configured (RPS):", s["request_rate"] if s["request_rate"] != "inf" else math.inf)
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"], "{}")
    row("Total generated tokens:", s["total_output_tokens"], "{}")
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for name in metrics:
        lines.append(f"{' ' + METRICS[name] + ' ':-^{width}}")
        short = name.upper() if name != "e2el" else "E2EL"
        row(f"Mean {short} (ms):", s[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", s[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", s[f"{pct_key(p)}_{name}_ms"])
    lines.append("=" * width)
    for e in s.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)
