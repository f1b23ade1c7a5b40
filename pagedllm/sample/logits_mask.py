"""Token bitmasks applied to a step's logits: structured outputs' allowed-token sets, and
allowed_token_ids (``apply_allowed_tokens``: one scatter over (row, token) pairs, one masked_fill).

A bitmask row holds one bit per vocabulary id in int32 words (bit ``i % 32`` of word ``i // 32``:
xgrammar's layout). ``apply_token_bitmask`` masks every constrained row in one call: on CPU our
C++ kernel (``kernels/csrc/sampling.h``: all-ones words skipped, the rest masked stores of -inf,
16 lanes at a time on AVX-512), else xgrammar's own kernel where it is installed (on CUDA), else
one shift-and-and over a [rows, words, 32] view and one masked_fill. No loop over requests or
tokens in Python either way. Ids past the logits width (a bitmask rounded up to
whole words) are dropped; ids past the bitmask (logits wider than the grammar's vocabulary) are
disallowed.
"""
from __future__ import annotations

import torch

from pagedllm.kernels import cpu as cpu_kernels

_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bool [rows, width]: True where the bit is set."""
    shifts = _SHIFTS.to(bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    pad = torch.zeros(allowed.shape[0], width - allowed.shape[1], dtype=torch.bool, device=allowed.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf on ``logits[rows[i]]`` wherever ``bitmask[i]`` has a 0 bit (in place; returns logits)."""
    width = logits.shape[1]
    kernels = cpu_kernels.for_tensor(logits)
    if (kernels is not None and logits.dtype == torch.float32
            and logits.stride(-1) == 1 and bitmask.stride(-1) == 1):
        kernels.apply_token_bitmask(logits, rows.to(torch.long).contiguous(), bitmask)
        return logits
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        apply_token_bitmask_inplace = None
    if apply_token_bitmask_inplace is not None and logits.dtype == torch.float32 and bitmask.shape[1] * 32 >= width:
        if rows.numel() == logits.shape[0]:  # every row (rows are 0..B-1): no index list, no host sync
            apply_token_bitmask_inplace(logits, bitmask, vocab_size=width)
            return logits
        # the kernel indexes logits and bitmask with the same row ids: spread the rows out
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device)
        full[rows] = bitmask
        apply_token_bitmask_inplace(logits, full, vocab_size=width, indices=rows.tolist())
        return logits
    return torch_apply_token_bitmask(logits, rows, bitmask)


def torch_apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The same with torch operations alone."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if rows.numel() == logits.shape[0]:  # every row is constrained (rows are 0..B-1 in order)
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def apply_allowed_tokens(logits: torch.Tensor, pair_rows: torch.Tensor, pair_cols: torch.Tensor,
                         rows: torch.Tensor) -> torch.Tensor:
    """-inf on ``logits[rows]`` except at the (row, token) pairs given (in place; returns logits)."""
    allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    allowed[pair_rows, pair_cols] = True
    keep = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    keep[rows] = False  # rows without allowed_token_ids keep every token
    logits.masked_fill_(~(allowed | keep.unsqueeze(1)), float("-inf"))
    return logits
