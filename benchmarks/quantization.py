"""Quantized weights on CPU: bf16 against int8 (W8A16 and W8A8), int4 (GPTQ layout, group 128) and
fp8 for the 1.1B random Llama (``llama-1b``: hidden 2048, 22 layers, 32 / 4 heads, intermediate
5632).

``--layers-only`` times just the matrix products of decoder layers (fused qkv 2048 -> 2560, o
2048 -> 2048, fused gate/up 2048 -> 11264, down 5632 -> 2048) with each layer's weights its own
copy, ``--layers`` of them (default all 22) so they stream from memory as in a decode step:
dense bf16 through the packed GEMM (layers/cpu_gemm.py) against the quantized kernels
(quantization/qgemm.py on weights prepared by qgemm.prepare). Formats take turns round by round
(the machine is shared: ratios are measured back to back) and the best round counts.

The full-model mode loads each format through the engine: bf16, ``quantization="int8"`` /
``"fp8"`` (on-the-fly, per channel, W8A16 / FP8 weights), a GPTQ 4-bit group-128 checkpoint
(int4) and a compressed-tensors W8A8 checkpoint (int8-w8a8, dynamic per-token activations), both
written once from the dense one by the tests' reference packers, and reports the model's
weight bytes, decode tok/s per batch (benchmarks/decode_bandwidth.py's method: 1 + D output
tokens minus 1 token, each length's best of 3) and the offline throughput of ``--requests`` random requests
(prompts 32-256, outputs 16-128 tokens).

``--per-shape`` times each product shape alone (``--copies`` weights of it, so they stream from
memory like a decode step's), bf16 against the weight-only formats, and with ``--baseline-build
PATH`` (a kernels .so of other sources, e.g. the previous commit's from the kernel cache) the same
products through that build too, side by side in one process. ``--cpu-time`` times with the
thread's CPU time instead of the wall clock: with ``--threads 1`` that leaves out the time the
thread waited for a core on a shared machine (caches and memory bandwidth stay shared).

    python benchmarks/quantization.py --layers-only --batches 1,16
    python benchmarks/quantization.py --per-shape --threads 1 --cpu-time --baseline-build OLD.so
    python benchmarks/quantization.py --formats bf16,int8,int8-w8a8,int4,fp8
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS, print_table, write_json  # noqa: E402
from decode_bandwidth import cpu_flags  # noqa: E402

FORMATS = {  # name -> (kind, group size (-1: per output channel), act_quant); bf16 is the dense model
    "bf16": None,
    "int8": ("int8", -1, None),
    "int8-w8a8": ("int8", -1, "int8_per_token"),
    "int4": ("int4", 128, None),
    "fp8": ("fp8", -1, None),
}


def layer_shapes(model: str) -> list[tuple[int, int]]:
    cfg = MODELS[model]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    return [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)]  # (N, K): qkv, o, gate_up, down


def quantize(w, kind: str, group: int, act_quant):
    """A dense [N, K] weight quantized symmetrically (the run-time form; int4 codes 0..15 around 8)."""
    import torch

    from pagedllm.quantization.quantized_weight import QuantizedWeight

    n, k = w.shape
    g = k if group == -1 else group
    wg = w.float().reshape(n, k // g, g)
    amax = wg.abs().amax(-1).clamp_min(1e-8)
    if kind == "int8":
        s = amax / 127
        q = torch.round(wg / s.unsqueeze(-1)).clamp(-127, 127).reshape(n, k).to(torch.int8)
    elif kind == "int4":
        s = amax / 7
        codes = (torch.round(wg / s.unsqueeze(-1)).clamp(-8, 7) + 8).reshape(n, k).to(torch.uint8)
        q = codes[:, 0::2] | (codes[:, 1::2] << 4)
    else:
        s = amax / 448
        q = (wg / s.unsqueeze(-1)).reshape(n, k).to(torch.float8_e4m3fn)
    return QuantizedWeight(kind, q, s.contiguous(), None, g, k, act_quant=act_quant)


def layers_only(args) -> list[dict]:
    import torch

    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.quantization import qgemm

    if args.threads:
        torch.set_num_threads(args.threads)  # the kernels' OpenMP regions follow torch's thread count
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the C++ kernels are not available: nothing to compare")
    shapes = layer_shapes(args.model)
    formats = args.formats.split(",")
    torch.manual_seed(0)
    layers = {f: [] for f in formats}
    for _ in range(args.layers):
        dense = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
        for f in formats:
            if FORMATS[f] is None:
                layers[f].append([kernels.pack_linear_weight(w) for w in dense])
            else:
                layers[f].append([qgemm.prepare(quantize(w, *FORMATS[f])) for w in dense])
    weight_bytes = {f: sum(t.numel() * t.element_size() if FORMATS[f] is None else t.nbytes()
                           for layer in layers[f] for t in layer) for f in formats}
    rows = []
    for m in (int(b) for b in args.batches.split(",")):
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for _, k in shapes}

        def step(f):
            for layer in layers[f]:
                for (n, k), w in zip(shapes, layer):
                    if FORMATS[f] is None:
                        kernels.packed_linear(xs[k], w, n, None)
                    else:
                        qgemm.quantized_linear(xs[k], w)

        best = {f: float("inf") for f in formats}
        for f in formats:
            step(f)  # warm-up
        for _ in range(args.rounds):
            for f in formats:
                t = time.perf_counter()
                step(f)
                best[f] = min(best[f], time.perf_counter() - t)
        for f in formats:
            rows.append({"batch": m, "format": f, "ms_per_step_all_layers": round(best[f] * 1e3 * 22 / args.layers, 1),
                         "GB_per_s": round(weight_bytes[f] / best[f] / 1e9, 1),
                         "vs_bf16": round(best["bf16"] / best[f], 2) if "bf16" in best else None,
                         "weight_MB": round(weight_bytes[f] * 22 / args.layers / 1e6)})
        print_table([r for r in rows if r["batch"] == m], list(rows[0]))
        print(flush=True)
    return rows


def per_shape(args) -> list[dict]:
    """Each product shape alone: bf16 packed_linear against quant_linear (this build, and the
    baseline build when given), microseconds per product, best of ``--rounds`` rounds taken in turn."""
    import importlib.machinery
    import importlib.util

    import torch

    from pagedllm.kernels import build
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.quantization import packed_qweight

    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the C++ kernels are not available: nothing to compare")
    builds = {"": kernels}
    if args.baseline_build:
        from pagedllm.kernels import isa

        name = build.module_name(isa.level(kernels.isa))  # the init symbol of a build of this level
        loader = importlib.machinery.ExtensionFileLoader(name, args.baseline_build)
        base = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
        loader.exec_module(base)
        builds = {"-base": base, "": kernels}
    clock = time.thread_time if args.cpu_time else time.perf_counter
    formats = [f for f in args.formats.split(",") if FORMATS[f] is None or FORMATS[f][2] is None]
    rows = []
    torch.manual_seed(0)
    for n, k in layer_shapes(args.model):
        dense = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for _ in range(args.copies)]
        weights = {f: [kernels.pack_linear_weight(w) if FORMATS[f] is None else
                       packed_qweight.pack(quantize(w, *FORMATS[f]), kernels) for w in dense] for f in formats}
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            runs = {}
            for f in formats:
                for tag, mod in ([("", kernels)] if FORMATS[f] is None else builds.items()):
                    def run(ws=weights[f], mod=mod, dense_w=FORMATS[f] is None):
                        for w in ws:
                            if dense_w:
                                mod.packed_linear(x, w, n, None)
                            else:
                                mod.quant_linear(x, w.packed, w.kind_code, w.scales, w.zeros, n, w.group_size,
                                                 w.input_perm, None)
                    runs[f + tag] = run
            best = {v: float("inf") for v in runs}
            for run in runs.values():
                run()  # warm-up
            for _ in range(args.rounds):
                for v, run in runs.items():
                    t = clock()
                    run()
                    best[v] = min(best[v], clock() - t)
            row = {"N": n, "K": k, "batch": m}
            for v in runs:
                row[f"{v}_us"] = round(best[v] / args.copies * 1e6)
            for v in runs:
                if v != "bf16" and "bf16" in runs:
                    row[f"{v}_vs_bf16"] = round(best["bf16"] / best[v], 2)
            rows.append(row)
            print(row, flush=True)
    return rows


INT8_TOKEN = {"num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True, "type": "int"}


def checkpoint(dense: str, fmt: str) -> tuple[str, dict]:
    """(path, LLM kwargs) of ``fmt``: on-the-fly for int8 / fp8, else a checkpoint written once
    from the dense one by the tests' reference packers (tests/quantization/packers.py), tensor by
    tensor: GPTQ 4-bit group 128 (int4) and compressed-tensors int-quantized W8A8 (int8-w8a8)."""
    if fmt == "bf16":
        return dense, {}
    if fmt in ("int8", "fp8"):
        return dense, {"quantization": fmt}
    path = f"{dense}-{fmt}"
    if os.path.exists(os.path.join(path, "config.json")):
        return path, {}
    import json
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "quantization"))
    from packers import LINEAR, _pack_module, ct_config, gptq_config

    if fmt == "int4":
        packer, opts, qconfig = "gptq", {"bits": 4, "group_size": 128}, gptq_config(bits=4, group_size=128)
    else:
        packer, opts = "ct-int", {}
        qconfig = ct_config("int-quantized", {"num_bits": 8, "strategy": "channel"}, INT8_TOKEN)
    gen = torch.Generator().manual_seed(0)
    out = {}
    with safe_open(os.path.join(dense, "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if LINEAR.search(name):
                out.update(_pack_module(packer, name[: -len(".weight")], t.float(), opts, gen)[0])
            else:
                out[name] = t
    tmp = path + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    for name in os.listdir(dense):
        if name != "model.safetensors" and os.path.isfile(os.path.join(dense, name)):
            shutil.copy(os.path.join(dense, name), tmp)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qconfig
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(tmp, path)
    return path, {}


def full_model(args) -> list[dict]:
    """Per format: weight bytes, decode tok/s per batch (1 + D output tokens minus 1, each best of 3),
    offline throughput of ``--requests`` random requests."""
    from common import ensure_model, random_workload
    from decode_bandwidth import weight_bytes_per_step

    from pagedllm import LLM, SamplingParams

    dense = ensure_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    reqs = random_workload(args.requests, 0, prompt_range=(32, 256), output_range=(16, 128))
    rows = []
    for fmt in args.formats.split(","):
        path, kw = checkpoint(dense, fmt)
        llm = LLM(model=path, dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=False,
                  kv_cache_memory=2 << 30, max_num_seqs=max(64, *batches), max_model_len=512,
                  cpu_threads=args.threads, **kw)
        row = {"format": fmt, "weight_MB": round(weight_bytes_per_step(llm.engine.core.executor.worker.model) / 1e6)}
        for b in batches:
            ids = [{"prompt_token_ids": p} for p, _ in random_workload(b, seed=b, prompt_range=(128, 128))]

            def timed(n: int) -> float:
                t = time.perf_counter()
                llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
                return time.perf_counter() - t

            timed(2)
            # each length's best of 3 (the best of differences turns one slow short run on a busy
            # machine into an absurd rate)
            short, long_ = zip(*[(timed(1), timed(1 + args.decode_tokens)) for _ in range(3)])
            step = (min(long_) - min(short)) / args.decode_tokens
            row[f"decode_b{b}_tok_s"] = round(b / step, 2)
        if args.requests:
            sps = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p, _ in reqs], sps, use_tqdm=False)
            row[f"throughput_{args.requests}req_tok_s"] = round(sum(len(p) + o for p, o in reqs) /
                                                              (time.perf_counter() - t), 1)
        llm.engine.shutdown()
        rows.append(row)
        print(row, flush=True)
    base = next((r for r in rows if r["format"] == "bf16"), None)
    if base is not None:
        for r in rows:
            for b in batches:
                r[f"b{b}_vs_bf16"] = round(r[f"decode_b{b}_tok_s"] / base[f"decode_b{b}_tok_s"], 2)
    print_table(rows, list(rows[0]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--formats", default="bf16,int8,int8-w8a8,int4,fp8")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--layers-only", action="store_true", help="time one decoder layer's matmuls per layer")
    ap.add_argument("--layers", type=int, default=22, help="--layers-only: decoder layers of weights")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--decode-tokens", type=int, default=16, help="full model: decode steps timed per batch")
    ap.add_argument("--requests", type=int, default=64, help="full model: throughput requests (0: skip)")
    ap.add_argument("--per-shape", action="store_true", help="time each product shape alone (weight-only formats)")
    ap.add_argument("--copies", type=int, default=8, help="--per-shape: weights per shape (they stream from memory)")
    ap.add_argument("--baseline-build", default=None, help="--per-shape: another kernels build (.so) to time too")
    ap.add_argument("--cpu-time", action="store_true", help="--per-shape: the thread's CPU time, not the wall clock")
    ap.add_argument("--out", default="benchmarks/results/quantization.json")
    args = ap.parse_args()
    mode = "per-shape" if args.per_shape else "layers-only" if args.layers_only else "full-model"
    rows = per_shape(args) if args.per_shape else layers_only(args) if args.layers_only else full_model(args)
    write_json(args.out, {"model": args.model, "mode": mode, "results": rows, "cpu_flags": cpu_flags(),
                          "argv": sys.argv})


if __name__ == "__main__":
    main()
