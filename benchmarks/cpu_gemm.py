"""Micro-benchmark of the CPU linear layers (pagedllm/layers/cpu_gemm.py): pagedllm's packed GEMM
(float32 and bfloat16 weights) beside oneDNN's (torch.ops.mkldnn packed linear, the fallback
without the C++ kernels) in the same dtype, so each bf16 row sits next to oneDNN's bf16.

One "step" multiplies M rows through the products of a whole model -- each layer's qkv, o,
gate_up and down weights (distinct tensors, so they stream from memory as in a decode step) plus
the LM head for M <= 128 -- with llama-100m's shapes by default. bf16 forms take and return bf16
activations, as a bf16 model's layers do. Rounds alternate the forms; the best round of each
counts (the speed of a shared VM drifts). The header line names the GEMM path the kernels were
compiled for (``gemm_path()``: avx512_bf16 / avx512 / avx2 / scalar) and the CPU's ISA flags.

    python benchmarks/cpu_gemm.py [--rows 1,8,16,32,64,512,2048] [--layers 12] [--forms ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402

from pagedllm.kernels import cpu as cpu_kernels  # noqa: E402
from pagedllm.layers import cpu_gemm  # noqa: E402

_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [f for f in _ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def model_weights(args) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    H, I, V = args.hidden, args.intermediate, args.vocab
    qkv = H + 2 * args.kv_heads * (H // args.heads)
    shapes = [(qkv, H), (H, H), (2 * I, H), (H, I)]
    g = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, k, generator=g) * 0.02 for n, k in shapes] for _ in range(args.layers)]
    return layers, torch.randn(V, H, generator=g) * 0.02


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16,32,64,512,2048")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--forms", default="", help="comma-separated subset of the form names (default: all)")
    ap.add_argument("--out", default="benchmarks/results/cpu_gemm.json")
    args = ap.parse_args()
    module = cpu_kernels.load()
    if module is None:
        raise SystemExit("the C++ kernels did not build (no compiler?)")
    path = module.gemm_path() if hasattr(module, "gemm_path") else "unknown (no gemm_path op)"

    layers, head = model_weights(args)
    bf16 = torch.bfloat16
    # name -> (pack a float32 weight, activation dtype)
    forms = {
        "ours f32": (lambda w: cpu_gemm.pack_panels(w), torch.float32),
        "ours bf16": (lambda w: cpu_gemm.pack_panels(w.to(bf16)), bf16),
    }
    if cpu_gemm.packing_available():
        forms["oneDNN f32"] = (lambda w: cpu_gemm.pack_weight(w, torch.float32), torch.float32)
        if cpu_gemm.packed_compute_dtype(bf16) == bf16:  # native bf16 in oneDNN on this CPU
            forms["oneDNN bf16"] = (lambda w: cpu_gemm.pack_weight(w, bf16), bf16)
    if args.forms:
        keep = [f.strip() for f in args.forms.split(",")]
        forms = {k: v for k, v in forms.items() if k in keep}
    packed = {name: ([[pack(w) for w in layer] for layer in layers], pack(head), dt)
              for name, (pack, dt) in forms.items()}
    flops_layer = sum(2 * w.shape[0] * w.shape[1] for w in layers[0])
    header = (f"GEMM path compiled: {path}; CPU flags: {' '.join(cpu_flags())}; {torch.get_num_threads()} threads")
    print(header, flush=True)

    rows = []
    for M in (int(m) for m in args.rows.split(",")):
        xs = {dt: (torch.randn(M, args.hidden).to(dt), torch.randn(M, args.intermediate).to(dt))
              for dt in (torch.float32, bf16)}
        with_head = M <= 128

        def step(ws, lm_head, dt):
            x_h, x_i = xs[dt]
            for qkv, o, gate_up, down in ws:
                for w, x in ((qkv, x_h), (o, x_h), (gate_up, x_h), (down, x_i)):
                    cpu_gemm.linear(x, w)
            if with_head:
                cpu_gemm.linear(x_h, lm_head)

        reps = max(1, 1000 // (M + 16))
        best = {name: float("inf") for name in packed}
        for name, p in packed.items():
            step(*p)  # warm-up
        for _ in range(args.rounds):
            for name, p in packed.items():
                t = time.perf_counter()
                for _ in range(reps):
                    step(*p)
                best[name] = min(best[name], (time.perf_counter() - t) / reps)
        flops = M * (args.layers * flops_layer + (2 * args.vocab * args.hidden if with_head else 0))
        row = {"rows": M}
        for name, sec in best.items():
            row[f"{name} ms"] = round(sec * 1e3, 2)
            row[f"{name} GFLOP/s"] = round(flops / sec / 1e9, 1)
        rows.append(row)
        print(row, flush=True)
    print(f"\n{header}\n{args.layers} layers x (qkv, o, gate_up, down) + LM head for rows <= 128;"
          f" best of {args.rounds} alternating rounds")
    print_table(rows, ["rows"] + [f"{n} GFLOP/s" for n in packed])
    write_json(args.out, {"args": vars(args), "gemm_path": path, "cpu_flags": cpu_flags(),
                          "threads": torch.get_num_threads(), "results": rows, "argv": sys.argv})


if __name__ == "__main__":
    main()
