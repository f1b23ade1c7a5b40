"""Result files: write one per run (command, machine, configuration, figures), read them back
(ours, or vLLM's ``vllm bench serve --save-result`` files, which hold one run each)."""
from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

from pagedllm.bench.environment import command_line, describe_machine, load_average

FORMAT = "pagedllm-bench/1"


def _finite(obj):
    """JSON without NaN/inf (strict parsers refuse them): None and "inf" instead."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def result_path(args, kind: str, model: Optional[str]) -> str:
    if args.result_filename:
        name = args.result_filename
    else:
        tag = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(str(model or "model").rstrip("/")))[:60]
        backend = f"-{args.backend}" if kind == "serve" else ""
        name = f"{kind}{backend}-{tag}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return os.path.join(args.result_dir or ".", name)


def write_result(path: str, kind: str, argv, config: dict, body: dict, load_before) -> str:
    data = {"format": FORMAT, "kind": kind, "command": command_line(argv), "machine": describe_machine(),
            "load_average_before": load_before, "load_average_after": load_average(), "config": config, **body}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_finite(data), f, indent=1)
    return path


@dataclass(frozen=True)
class LoadedResult:
    path: str
    label: str
    kind: str  # serve, throughput, latency
    runs: list  # serve: one dict per request rate; else [the result]
    data: dict


def read_json(path: str, name: str):
    """A JSON file's content; a missing or malformed file is a ValueError naming ``name``."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{name} {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} {path!r} is not JSON: {e}") from None


def load_result(path: str, label: Optional[str] = None) -> LoadedResult:
    data = read_json(path, "result")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a benchmark result (a JSON object)")
    label = label or os.path.splitext(os.path.basename(path))[0]
    if data.get("format") == FORMAT:
        kind = data.get("kind")
        runs = data.get("runs") if kind == "serve" else [data]
        if kind not in ("serve", "throughput", "latency") or not runs:
            raise ValueError(f"{path}: unknown result kind {kind!r}")
        return LoadedResult(path, label, kind, runs, data)
    if "ttfts" in data and "output_throughput" in data:  # a vLLM serving result: one run
        return LoadedResult(path, label, "serve", [data], data)
    if "avg_latency" in data and "latencies" in data:
        return LoadedResult(path, label, "latency", [data], data)
    if "requests_per_second" in data:
        return LoadedResult(path, label, "throughput", [data], data)
    raise ValueError(f"{path}: not a pagedllm or vLLM benchmark result")
