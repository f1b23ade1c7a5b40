"""8-bit KV cache dtypes (``EngineConfig.kv_cache_dtype``): storage, scales and the reference
quantizer every backend matches.

Scheme: dynamic, symmetric, one scale per token and kv head. When a token's K (or V) row of
one kv head is written into the cache, ``scale = max|x| / qmax`` (rounded to bfloat16) and the
row is stored as ``x / scale`` in 8 bits (int8: rounded half to even and clamped to +-127; fp8:
clamped to the format's largest finite value, then rounded to nearest even by the format
conversion). Reading multiplies back by the scale inside the attention kernels.

Why per token and head, and why dynamic: a static per-tensor scale (vLLM's FP8 default is 1.0)
needs calibration, and activations outside the fp8 range saturate (int8 with scale 1.0 would be
useless); a per-token-per-head scale adapts to every row at the cost of 2 bytes per (token, kv
head, K or V). With bfloat16 scales (8-bit exponent: any float32 magnitude fits) a head dim of
64 stores 66 bytes where bfloat16 stores 128 (1.94x the tokens), 128 stores 130 vs 256 (1.97x).
The scales live in their own tensor beside the cache ([planes, layers, num_blocks, block_size,
num_kv_heads]), allocated with it and counted in its memory budget.

The C++ kernels (``write_kv_quant``), the Triton write (triton_kv_quant.py, for CUDA) and this
reference produce the same bytes: the same float32 division and the same rounding (tests compare
them bit for bit). Run the reference on CPU tensors when comparing: on CUDA torch divides by a
scalar through its reciprocal, so ``amax / qmax`` can differ in the last bit there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SCALE_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class KVQuant:
    name: str  # canonical kv_cache_dtype
    dtype: torch.dtype  # storage dtype of the cache
    qmax: float  # largest stored magnitude


_SPECS = {
    "fp8_e4m3": KVQuant("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVQuant("fp8_e5m2", torch.float8_e5m2, 57344.0),
    "int8": KVQuant("int8", torch.int8, 127.0),
}
QUANTIZED_KV_CACHE_DTYPES = tuple(_SPECS)
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """What the KV cache planes hold: the model dtype ("auto"), float32 (a float32 model's own),
    bfloat16 (also under a float32 model: half the bytes per token, float32 arithmetic on the rows
    read), or an 8-bit dtype."""
    if kv_cache_dtype == "bfloat16":
        return torch.bfloat16
    if kv_cache_dtype == "float32":
        return torch.float32
    quant = kv_quant(kv_cache_dtype)
    return model_dtype if quant is None else quant.dtype


def kv_quant(kv_cache_dtype: str) -> Optional[KVQuant]:
    """The 8-bit scheme of ``kv_cache_dtype`` ("fp8" = "fp8_e4m3"); None for the 16/32-bit caches
    ("auto", "float32", "bfloat16")."""
    if kv_cache_dtype in UNQUANTIZED_KV_CACHE_DTYPES:
        return None
    name = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
    if name not in _SPECS:
        raise ValueError(f"kv_cache_dtype must be one of {UNQUANTIZED_KV_CACHE_DTYPES + QUANTIZED_KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return _SPECS[name]


def for_storage(dtype: torch.dtype) -> KVQuant:
    """The scheme whose cache is stored as ``dtype``."""
    for spec in _SPECS.values():
        if spec.dtype == dtype:
            return spec
    raise ValueError(f"no 8-bit KV cache scheme stores {dtype}")


def quantize(x: torch.Tensor, spec: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (values [..., D] in ``spec.dtype``, scales [...] bfloat16)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / spec.qmax).to(SCALE_DTYPE)
    s = scale.float().unsqueeze(-1)
    y = torch.where(s > 0, xf / s, torch.zeros((), dtype=torch.float32, device=x.device))
    y = y.clamp(-spec.qmax, spec.qmax)
    if spec.dtype == torch.int8:
        return torch.round(y).to(torch.int8), scale
    return y.to(spec.dtype), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] 8-bit, scales [...] -> [..., D] in ``dtype``."""
    return (values.float() * scales.float().unsqueeze(-1)).to(dtype)


def write_quantized(cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor,
                    spec: KVQuant) -> None:
    """The torch path of a cache write: x [T, Hkv, D] quantized into cache [num_blocks, bs, Hkv, D]
    and scales [num_blocks, bs, Hkv] at ``slot_mapping`` (negative slots: padding, skipped)."""
    Hkv, D = cache.shape[-2], cache.shape[-1]
    q, s = quantize(x[: slot_mapping.shape[0]], spec)
    keep = slot_mapping >= 0
    slots = slot_mapping
    if not bool(keep.all()):
        slots, q, s = slot_mapping[keep], q[keep], s[keep]
    # byte views: index_copy_ has no float8 kernel on every device
    cache.view(torch.uint8).view(-1, Hkv, D).index_copy_(0, slots, q.view(torch.uint8))
    scales.view(-1, Hkv).index_copy_(0, slots, s)


def gather_dequantized(cache: torch.Tensor, scales: torch.Tensor, block_ids: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``block_ids`` of cache [num_blocks, bs, Hkv, D], dequantized: [len, bs, Hkv, D].
    Only the gathered blocks are converted, never the whole cache."""
    values = cache.view(torch.uint8).index_select(0, block_ids).view(cache.dtype)
    return dequantize(values, scales.index_select(0, block_ids), dtype)


def bytes_per_element(spec: Optional[KVQuant], model_dtype: torch.dtype) -> int:
    return 1 if spec is not None else torch.empty((), dtype=model_dtype).element_size()


def scale_bytes_per_head(spec: Optional[KVQuant]) -> int:
    return 0 if spec is None else torch.empty((), dtype=SCALE_DTYPE).element_size()
