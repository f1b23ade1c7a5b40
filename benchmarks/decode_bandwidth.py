"""Decode speed against the memory limit: tokens/s of batch-1 and batch-16 decode steps and the
fraction of the machine's measured memory bandwidth they reach.

A decode step must read every weight once (the embedding table aside: only B rows of it) plus
each sequence's KV cache; on a CPU that is what bounds batch-1 decode. Bytes per step / time per
step, against a plain multi-threaded streaming read of a 1 GiB buffer measured in the same run,
is the fraction of the bandwidth limit reached. Decode time per step is isolated from prefill by
timing the same prompts with 1 output token and with 1 + D (prefix caching off, so the second
run computes its prefill again).

    python benchmarks/decode_bandwidth.py --model llama-1b --dtype bfloat16 --batches 1,16
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, print_table, random_workload, write_json  # noqa: E402


def cpu_flags() -> dict:
    """The CPU model and its SIMD flags (every figure is recorded with them)."""
    info = {"model": "", "flags": []}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not info["model"]:
                info["model"] = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not info["flags"]:
                info["flags"] = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    info["cores"] = os.cpu_count()
    return info


def stream_bandwidth(gib: float = 1.0, rounds: int = 5) -> float:
    """Bytes/s of a multi-threaded streaming read (a float32 sum over a buffer far above cache)."""
    import torch

    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def weight_bytes_per_step(model) -> int:
    """Bytes a decode step reads of the weights: every parameter but the input embedding table,
    of which it reads only B rows (a tied LM head has its own packed copy, counted as the head)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if not name.endswith("embed_tokens.weight"))


def run(path: str, dtype: str, batch: int, prompt_len: int, decode_tokens: int, threads: int | None) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=path, dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
              kv_cache_memory=2 << 30, max_num_seqs=max(batch, 1), max_model_len=prompt_len + decode_tokens + 8,
              cpu_threads=threads)
    prompts = [p for p, _ in random_workload(batch, seed=batch, prompt_range=(prompt_len, prompt_len))]
    ids = [{"prompt_token_ids": p} for p in prompts]

    def timed(max_tokens: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(ids, sp, use_tqdm=False)
        return time.perf_counter() - t

    timed(2)  # warm-up
    best = float("inf")
    for _ in range(2):
        best = min(best, timed(1 + decode_tokens) - timed(1))
    step = best / decode_tokens
    worker = llm.engine.core.executor.worker
    spec = worker.kv_spec
    kv_per_token = spec.bytes_per_block // spec.block_size
    mean_len = prompt_len + decode_tokens / 2
    weights = weight_bytes_per_step(worker.model)
    kv = int(batch * mean_len * kv_per_token)
    llm.engine.shutdown()
    return {"batch": batch, "step_ms": round(step * 1e3, 2), "tok_s": round(batch / step, 1),
            "weight_bytes": weights, "kv_bytes": kv, "bytes_per_s": (weights + kv) / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b", help="llama-tiny | llama-100m | llama-1b | a checkpoint path")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--out", default="benchmarks/results/decode_bandwidth.json")
    args = ap.parse_args()

    path = ensure_model(args.model) if not os.path.isdir(args.model) else args.model
    bw = stream_bandwidth()
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        r = run(path, args.dtype, b, args.prompt_len, args.decode_tokens, args.threads)
        r["of_bandwidth"] = round(r.pop("bytes_per_s") / bw, 3)
        rows.append(r)
        print(f"batch {b}: {r['tok_s']} tok/s, {r['of_bandwidth']:.0%} of the streaming bandwidth", flush=True)
    print(f"\nmodel={args.model} dtype={args.dtype} prompt_len={args.prompt_len} decode_tokens={args.decode_tokens} "
          f"streaming read {bw / 1e9:.1f} GB/s")
    print_table(rows, ["batch", "step_ms", "tok_s", "weight_bytes", "kv_bytes", "of_bandwidth"])
    write_json(args.out, {"model": args.model, "dtype": args.dtype, "stream_read_GBps": round(bw / 1e9, 2),
                          "results": rows, "cpu": cpu_flags(), "argv": sys.argv})


if __name__ == "__main__":
    main()
