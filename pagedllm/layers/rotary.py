"""Rotary position embedding (neox/HF "rotate_half" layout), with rope_scaling variants: linear,
llama3, yarn, longrope (Phi-3's su: short and long factor sets)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels


def _yarn(inv_freq: torch.Tensor, head_dim: int, base: float, rs: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as HF computes it: interpolated low frequencies, extrapolated high
    ones with a linear ramp between, and cos/sin scaled by the attention factor."""
    orig = float(rs["original_max_position_embeddings"])
    factor = float(rs.get("factor") or max_position / orig)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rs.get("attention_factor")
    if attn is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attn)


def _longrope_scale(rs: dict, max_position: int) -> tuple[float, float]:
    orig = float(rs["original_max_position_embeddings"])
    factor = float(rs.get("factor") or max_position / orig)
    attn = rs.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return orig, float(attn)


def _inv_freq(head_dim: int, base: float, rope_scaling: Optional[dict],
              max_position: int = 0) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scale = 1.0
    if not rope_scaling:
        return inv_freq, scale
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, scale
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, base, rope_scaling, max_position)
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"]), scale
    if kind == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        old_ctx = float(rope_scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), scale
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn, longrope)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: Optional[dict] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        t = torch.arange(max_position, dtype=torch.int64).float()
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
        if kind in ("longrope", "su"):
            # LongRoPE (Phi-3): per-frequency factors, the short set for positions below
            # original_max_position_embeddings and the long set from there on. HF picks one set
            # per forward call from the longest sequence; the two agree while a sequence stays
            # below that length (docs/usage.md).
            orig, scale = _longrope_scale(rope_scaling, max_position)
            base_freq = base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
            short = 1.0 / (torch.tensor(rope_scaling["short_factor"], dtype=torch.float32) * base_freq)
            long = 1.0 / (torch.tensor(rope_scaling["long_factor"], dtype=torch.float32) * base_freq)
            freqs = torch.where((t < orig)[:, None], torch.outer(t, short), torch.outer(t, long))
        else:
            inv_freq, scale = _inv_freq(head_dim, base, rope_scaling, max_position)
            freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)
        self._tables_by_dtype: dict = {}  # dtype -> (cos, sin) tables in it, made on first use

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Looked up once per forward and shared by every layer: ([T, 1, D], [T, 1, D]); two
        row gathers from tables kept in ``dtype`` (the same values as gathering the float32
        tables and rounding the rows)."""
        cos, sin = self._tables(dtype)
        return cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)

    def _tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self._tables_by_dtype.get(dtype)
        if tables is None or tables[0].device != self.cos_cache.device:  # made once (again after a move)
            tables = self._tables_by_dtype[dtype] = (self.cos_cache.to(dtype), self.sin_cache.to(dtype))
        return tables


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def apply_rotary(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hkv, D] rotated by the step's shared (cos, sin). The CPU kernel
    rotates q and k in place (they are the caller's fresh projections) and returns them."""
    cos, sin = cos_sin
    kernels = cpu_kernels.for_tensor(q)
    if kernels is not None and cos.dtype == q.dtype and _heads_contiguous(q) and _heads_contiguous(k):
        T = q.shape[0]
        cos2, sin2 = cos.view(T, -1), sin.view(T, -1)
        kernels.rotary_inplace(q, cos2, sin2)
        kernels.rotary_inplace(k, cos2, sin2)
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_partial_rotary(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
    """Rotary over the first ``cos.shape[-1]`` dims of each head only (GPT-NeoX's ``rotary_pct``,
    Phi's and StableLM's ``partial_rotary_factor``); the rest pass through. Whole heads: as
    ``apply_rotary``."""
    rot = cos_sin[0].shape[-1]
    if rot == q.shape[-1]:
        return apply_rotary(cos_sin, q, k)
    cos, sin = cos_sin
    q_rot, k_rot = q[..., :rot], k[..., :rot]
    q_rot = q_rot * cos + _rotate_half(q_rot) * sin
    k_rot = k_rot * cos + _rotate_half(k_rot) * sin
    return torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)
