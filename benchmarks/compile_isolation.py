"""What a grammar compile costs in a compile worker process (structured_compile_isolation
"process", the default) against one on the calling thread ("thread"), and what a worker costs
to start and to keep: issue 29's interruptible compiles.

For each constraint shape, ``--rounds`` distinct constraints (so no cache hit) are compiled each
way, alternated; the table gives the median and minimum wall time per compile (the worker's
includes sending the key, the compile, serialize_json, the pipe and deserialize_json here), the
compiled grammar's memory_size_bytes and its serialized size. On the embedded default model
unless --model.

    python benchmarks/compile_isolation.py --rounds 5 --json benchmarks/results/compile_isolation.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import print_table, write_json  # noqa: E402


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def shapes():
    from pagedllm.sampling_params import StructuredOutputsParams as S

    return {
        "schema_small": lambda i: S(json={"type": "object", "properties": {f"a{i}": {"type": "integer"},
                                                                          "b": {"type": "string", "maxLength": 8}}}),
        "regex_small": lambda i: S(regex=f"[a-e]{{2}}q{i}(rs|tu)[0-9]{{3}}"),
        "regex_4kb_soak": lambda i: S(regex="(" + "|".join(f"w{i}_{k}[a-z]{{1,3}}" for k in range(400)) + ")+"),
        "grammar_small": lambda i: S(grammar=f'root ::= "n{i}" [0-9]+ ("," [0-9]+)*'),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    rss_start = _rss_mib()  # before xgrammar (and with it torch and transformers) is imported
    from pagedllm.config import default_model_path
    from pagedllm.models.config_json import load_hf_config
    from pagedllm.structured_output.backend import CompileIsolation, GrammarBackend, spec_key
    from pagedllm.structured_output.compile_process import _status_kib
    from pagedllm.tokenizer.tokenizer import load_tokenizer

    model = args.model or default_model_path()
    cfg = load_hf_config(model)
    tokenizer = load_tokenizer(model)
    rss_tokenizer = _rss_mib()
    backend = GrammarBackend(tokenizer, cfg.vocab_size, [0], isolation=CompileIsolation())
    rss_backend = _rss_mib()
    load_before = open("/proc/loadavg").read().split()[:3]
    from pagedllm.sampling_params import StructuredOutputsParams as S

    t0 = time.perf_counter()
    backend._compile_in_worker(spec_key(S(regex="warm")), 300, None)
    start_s = time.perf_counter() - t0
    worker = backend._pool.workers[0]
    worker_rss = _status_kib(worker.pid, "VmRSS") / 1024
    rows = []
    for name, make in shapes().items():
        times = {"thread": [], "process": []}
        size = serialized = 0
        for i in range(args.rounds):
            for where in ("thread", "process"):
                key = spec_key(make(2 * i + (where == "process")))
                t = time.perf_counter()
                compiled = backend._compile(key) if where == "thread" else backend._compile_in_worker(key, 300, None)
                times[where].append(time.perf_counter() - t)
                size, serialized = compiled.memory_size_bytes, len(compiled.serialize_json())
        row = {"constraint": name}
        for where, ts in times.items():
            row[f"{where}_median_ms"] = round(1e3 * statistics.median(ts), 1)
            row[f"{where}_min_ms"] = round(1e3 * min(ts), 1)
        row["memory_size_mib"] = round(size / 2**20, 2)
        row["serialized_mib"] = round(serialized / 2**20, 2)
        rows.append(row)
    worker_rss_after = _status_kib(worker.pid, "VmRSS") / 1024 if worker.pid else None
    backend.shutdown()
    rss_compiled = _rss_mib()  # this process after the thread compiles (cached)
    backend._cache.clear()
    import gc

    gc.collect()
    rss_dropped = _rss_mib()
    from pagedllm.heap import trim_freed_memory

    trim_freed_memory()
    rss_trimmed = _rss_mib()
    load_after = open("/proc/loadavg").read().split()[:3]
    print(f"model {model} (vocab {cfg.vocab_size}); worker start + first compile {start_s:.2f} s; worker RSS "
          f"{worker_rss:.0f} MiB at start, {worker_rss_after} MiB after; tokenizer info "
          f"{len(backend.tokenizer_info.serialize_json()) / 2**20:.2f} MiB as JSON; load average {' '.join(load_before)} -> "
          f"{' '.join(load_after)}")
    print(f"this process's RSS: {rss_start:.0f} MiB at start, {rss_tokenizer:.0f} with the tokenizer, "
          f"{rss_backend:.0f} with xgrammar's backend, {rss_compiled:.0f} after the compiles, {rss_dropped:.0f} "
          f"with the cache dropped, {rss_trimmed:.0f} after malloc_trim")
    cols = ["constraint", "thread_median_ms", "process_median_ms", "thread_min_ms", "process_min_ms",
            "memory_size_mib", "serialized_mib"]
    print_table(rows, cols)
    write_json(args.json, {"command": " ".join(sys.argv), "model": model, "rounds": args.rounds,
                           "worker_start_s": round(start_s, 2), "worker_rss_mib": round(worker_rss, 1),
                           "worker_rss_after_mib": worker_rss_after, "load_before": load_before,
                           "load_after": load_after, "rows": rows,
                           "rss_mib": {"start": rss_start, "tokenizer": rss_tokenizer, "backend": rss_backend,
                                       "compiled": rss_compiled, "cache_dropped": rss_dropped,
                                       "trimmed": rss_trimmed}})


if __name__ == "__main__":
    main()
