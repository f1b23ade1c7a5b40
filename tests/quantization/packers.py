"""Reference packers: a dense tiny checkpoint rewritten into each quantized on-disk layout.

The quantization tools do not install beside our pins (gptqmodel wants a newer torch and CUDA,
llm-compressor an older transformers); tool_checkpoints/ holds a few checkpoints they made once in
throwaway virtualenvs, and the options those do not cover (gptq_v2, Qwen2 biases, ...) come
from here, each documented layout written from the format
descriptions: GPTQ (AutoGPTQ / optimum ``QuantLinear``: qweight packed along K, qzeros minus one
in the ``gptq`` checkpoint_format), AWQ (AutoAWQ ``WQLinear_GEMM``: packed along N in the
0,2,4,6,1,3,5,7 order), compressed-tensors (``pack_to_int32``: signed codes + 2**(bits-1), packed
along K; zero points along N), FP8 (``weight`` e4m3 + ``weight_scale`` / ``weight_scale_inv``).

``quantize_checkpoint`` returns the reference dequantized float32 weight of every quantized
checkpoint module (computed from the stored codes and the stored-precision scales, independently of
pagedllm) and writes ``<dst>-dequant``, the dense checkpoint with those weights.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in 0..2**32-1 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along(codes: torch.Tensor, bits: int, axis: int, order=None) -> torch.Tensor:
    """Unsigned codes -> int32 words along ``axis``; element ``order[j]`` of each run at bits ``j*bits``."""
    per = 32 // bits
    c = codes.to(torch.int64).movedim(axis, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    if order is not None:
        c = c[..., list(order)]
    words = (c << (torch.arange(per) * bits)).sum(-1)
    return to_int32(words).movedim(-1, axis).contiguous()


def int_quantize(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx=None, scale_dtype=torch.float16):
    """Per (row, group) min/max quantization -> (unsigned codes [N, K], zeros [N, G] int, scales [N, G]
    in ``scale_dtype``); ``g_idx`` [K] assigns columns to groups (default k // group)."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    groups = int(g_idx.max()) + 1
    maxq = 2**bits - 1
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s = 2 * cols.abs().amax(1) / maxq
            z = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / maxq
            z = torch.round(-lo / s).to(torch.int64).clamp(1, maxq)  # >= 1: GPTQ v1 cannot store 0
        scales[:, g], zeros[:, g] = s, z
    scales = scales.to(scale_dtype)
    s_full, z_full = scales.float()[:, g_idx], zeros[:, g_idx]
    codes = (torch.round(w / s_full) + z_full).clamp(0, maxq).to(torch.int64)
    deq = (codes - z_full).float() * s_full
    return codes, zeros, scales, deq


def fp8_quantize(w: torch.Tensor, per_channel: bool, block=None, scale_dtype=torch.float32):
    if block is not None:
        bn, bk = block
        n, k = w.shape
        blocks = w.reshape(n // bn, bn, k // bk, bk)
        s = (blocks.abs().amax(dim=(1, 3)) / 448.0).to(scale_dtype)
        sf = s.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    else:
        s = (w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)) / 448.0
        s = s.to(scale_dtype)
        sf = s.float()
    q = (w / sf).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s, q.float() * sf


def _pack_module(fmt: str, base: str, w: torch.Tensor, opts: dict, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    bits, group = opts.get("bits", 4), opts.get("group_size", 32)
    group = k if group == -1 else group
    if fmt == "gptq":
        g_idx = None
        if opts.get("desc_act"):
            # the act-order: column perm[j] is the j-th quantized; one order per input (q/k/v share it)
            key = (re.sub(r"(q|k|v)_proj$", "qkv", re.sub(r"(gate|up)_proj$", "gate_up", base)))
            perm = opts.setdefault("_perms", {}).setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // group
        codes, zeros, scales, deq = int_quantize(w, bits, group, opts.get("sym", True), g_idx)
        stored_z = zeros if opts.get("v2") else (zeros - 1) & (2**bits - 1)
        g_idx = torch.arange(k) // group if g_idx is None else g_idx
        return {f"{base}.qweight": pack_along(codes.t(), bits, 0), f"{base}.qzeros": pack_along(stored_z.t(), bits, 1),
                f"{base}.scales": scales.t().contiguous(), f"{base}.g_idx": g_idx.to(torch.int32)}, deq
    if fmt == "awq":
        codes, zeros, scales, deq = int_quantize(w, 4, group, sym=False)
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        return {f"{base}.qweight": pack_along(codes.t(), 4, 1, order), f"{base}.qzeros": pack_along(zeros.t(), 4, 1, order),
                f"{base}.scales": scales.t().contiguous()}, deq
    if fmt == "ct-pack":
        sym = opts.get("sym", True)
        codes, zeros, scales, deq = int_quantize(w, bits, group, sym, scale_dtype=torch.float32)
        out = {f"{base}.weight_packed": pack_along(codes, bits, 1), f"{base}.weight_scale": scales,
               f"{base}.weight_shape": torch.tensor([n, k])}
        if not sym:  # zero points in the signed range, stored + 2**(bits-1) like the codes
            out[f"{base}.weight_zero_point"] = pack_along(zeros, bits, 0)
        return out, deq
    if fmt == "ct-int":  # symmetric int8 per channel, codes -127..127 stored signed
        codes, zeros, scales, deq = int_quantize(w, 8, k, sym=True, scale_dtype=torch.float32)
        return {f"{base}.weight": (codes - 128).to(torch.int8), f"{base}.weight_scale": scales}, deq
    if fmt in ("ct-float", "fp8"):
        block = opts.get("block")
        q, s, deq = fp8_quantize(w, opts.get("per_channel", True), block)
        name = "weight_scale_inv" if block and fmt == "fp8" else "weight_scale"
        scale = s if (block or opts.get("per_channel", True)) else s.reshape(() if fmt == "fp8" else (1,))
        out = {f"{base}.weight": q, f"{base}.{name}": scale}
        if opts.get("input_scale") is not None:
            out[f"{base}.input_scale"] = torch.tensor(opts["input_scale"], dtype=torch.float32).reshape(
                () if fmt == "fp8" else (1,))
        return out, deq
    raise ValueError(fmt)


def quantize_checkpoint(src: str, dst: str, fmt: str, qconfig: dict, skip=(), seed: int = 0, **opts) -> dict:
    """Write ``dst`` (``src``'s tensors, its linear layers in ``fmt``; module names matching a regex in
    ``skip`` stay dense) and ``dst + '-dequant'``; return {checkpoint module: reference weight}."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out, dense, ref = {}, {}, {}
    for name, t in tensors.items():
        if LINEAR.search(name) and not any(re.search(p, name) for p in skip):
            base = name[: -len(".weight")]
            packed, deq = _pack_module(fmt, base, t.float(), opts, gen)
            out.update(packed)
            dense[name] = deq
            ref[base] = deq
        else:
            out[name] = t
            dense[name] = t
    for path, tensors_out, qc in ((dst, out, qconfig), (dst + "-dequant", dense, None)):
        os.makedirs(path, exist_ok=True)
        for f in os.listdir(src):
            if f != "model.safetensors" and os.path.isfile(os.path.join(src, f)):
                shutil.copy(os.path.join(src, f), path)
        save_file({k: v.contiguous() for k, v in tensors_out.items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
        if qc is not None:
            with open(os.path.join(path, "config.json")) as f:
                cfg = json.load(f)
            cfg["quantization_config"] = qc
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(cfg, f, indent=2)
    return ref


def gptq_config(bits=4, group_size=32, desc_act=False, sym=True, checkpoint_format="gptq") -> dict:
    """As optimum / transformers write it (GPTQConfig.to_dict)."""
    return {"bits": bits, "group_size": group_size, "damp_percent": 0.1, "desc_act": desc_act, "sym": sym,
            "true_sequential": True, "quant_method": "gptq", "checkpoint_format": checkpoint_format,
            "model_seqlen": None, "block_name_to_quantize": None, "module_name_preceding_first_block": None,
            "batch_size": 1, "pad_token_id": None, "use_exllama": False, "max_input_length": None,
            "cache_block_outputs": True, "modules_in_block_to_quantize": None,
            "meta": {"quantizer": ["optimum:1.23.3", "gptqmodel:1.4.5"]}}


def awq_config(group_size=32) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def ct_config(fmt: str, weights: dict, input_activations=None, ignore=("lm_head",)) -> dict:
    """As llm-compressor writes it (compressed-tensors QuantizationConfig)."""
    w = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
         "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": True, "type": "int"}
    w.update(weights)
    group = {"input_activations": input_activations, "output_activations": None, "targets": ["Linear"], "weights": w}
    return {"config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": None,
            "ignore": list(ignore), "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed"}


def module_weight(model, name: str, parts=None):
    """pagedllm's dequantized weight of one of our linear modules (QuantizedWeight.dequantize())."""
    return dict(model.named_modules())[name].quantized.dequantize()
