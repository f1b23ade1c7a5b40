"""A linear layer with ``max_loras`` adapter slots beside its base weight.

``LoRALinear`` wraps one of the model's column- or row-parallel linear modules (a fused one too:
qkv_proj holds the q, k and v targets, gate_up_proj gate and up) and adds, for the rows of each
adapter, ``x @ A.T @ B.T`` (B carries the adapter's scaling). Per slot it stores

    lora_a [max_loras, n_targets * max_rank, in_local]   the present targets' A stacked on the rank dim
    lora_b [max_loras, out_local, max_rank]              each target's B at its output offset

    lora_b [max_loras, out_local, n_targets * max_rank]  block-diagonal: target j's B in its output
                                                         rows and its rank columns, zeros elsewhere

zero-padded to the largest rank. The shrink is one product per slot (every target at once), and
so is the expand (the block-diagonal B puts each target's delta at its output offset; a target
the adapter leaves out has no columns).

Tensor parallel: a column-parallel layer holds full A and its rank's rows of B (sliced like the
base weight's output, q/k/v by heads); a row-parallel layer holds its rank's columns of A and full
B, and the shrunk [rows, r] activations are summed across ranks (one small all-reduce per layer)
before the expand, so every rank adds the whole delta to the all-reduced base output.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.layers.cpu_gemm import linear, pack_panels, pack_weight, packed_compute_dtype
from pagedllm.lora.batch import LoRAStepState


def pack_for_gemm(w: torch.Tensor) -> torch.Tensor:
    """A slot's A or B in the form the CPU GEMM runs fastest (pagedllm's panels when the C++
    kernels are loaded, else oneDNN's blocked layout; dense on GPU): small products in bf16
    through torch's generic path cost several times their FLOPs."""
    if w.device.type != "cpu":
        return w
    w = w.contiguous()
    kernels = cpu_kernels.ready()
    if kernels is not None and w.dtype in (torch.float32, torch.bfloat16):
        return pack_panels(w, kernels)
    compute = packed_compute_dtype(w.dtype)
    return pack_weight(w, compute) if compute is not None else w


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, targets: tuple[str, ...], out_sizes: list[int], in_features: int,
                 row_parallel: bool, state: LoRAStepState, max_loras: int, max_rank: int, tp,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.targets = targets
        self.out_sizes = list(out_sizes)  # this rank's output features per target
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.in_features = in_features  # this rank's input features
        self.row_parallel = row_parallel
        self.state = state
        self.tp = tp
        self.max_rank = max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, len(targets) * max_rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, sum(out_sizes), len(targets) * max_rank, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("slot_cols", torch.zeros(max_loras, dtype=torch.int32, device=device), persistent=False)
        self.use_triton = torch.device(device).type == "cuda"  # the segmented Triton kernels (lora/triton_ops.py)
        self.packed: list = [None] * max_loras  # per slot (A, B) as the GEMM wants them (see pack_for_gemm)
        self.slot_rank = [0] * max_loras  # host copies: the rank in each slot (0: no delta for this layer)
        self.slot_targets: list[tuple[int, ...]] = [()] * max_loras  # target indices present, in stacked order

    def set_slot(self, slot: int, rank: int, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Load one adapter's (A, B) per target index (already sliced for this rank) into ``slot``."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        present = tuple(sorted(pieces))
        for j, t in enumerate(present):
            A, B = pieces[t]
            a[j * rank:(j + 1) * rank].copy_(A)
            b[self.offsets[t]:self.offsets[t] + self.out_sizes[t], j * rank:(j + 1) * rank].copy_(B)
        self.slot_rank[slot] = rank if present else 0
        self.slot_targets[slot] = present
        n = len(present) * rank
        self.slot_cols[slot] = n
        if not self.use_triton:
            self.packed[slot] = (pack_for_gemm(a[:n]), pack_for_gemm(b[:, :n])) if present else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is None:
            return y
        if self.use_triton:
            return self._forward_triton(x, y, batch)
        xs = x if batch.index is None else x.index_select(0, batch.index)
        shrunk = []  # (slot, start, end, [rows, n * r])
        for slot, start, end in batch.groups:
            if self.slot_rank[slot]:
                shrunk.append((slot, start, end, linear(xs[start:end], self.packed[slot][0])))
        if not shrunk:
            return y
        if self.row_parallel and self.tp.world_size > 1:  # partial sums over this rank's input columns
            flat = self.tp.all_reduce(torch.cat([t.reshape(-1) for *_, t in shrunk]))
            parts, at = [], 0
            for slot, start, end, t in shrunk:
                parts.append((slot, start, end, flat[at:at + t.numel()].view_as(t)))
                at += t.numel()
            shrunk = parts
        for slot, start, end, t in shrunk:
            delta = linear(t, self.packed[slot][1])
            if batch.index is None:
                y += delta
            else:
                y.index_add_(0, batch.index[start:end], delta)
        return y

    def _forward_triton(self, x: torch.Tensor, y: torch.Tensor, batch) -> torch.Tensor:
        """Two launches for every adapter of the step: shrink, (all-reduce,) expand into y."""
        if not any(self.slot_rank[slot] for slot, _, _ in batch.groups):
            return y
        from pagedllm.lora.triton_ops import lora_expand, lora_shrink

        t = lora_shrink(x, self.lora_a, self.slot_cols, batch)
        if self.row_parallel and self.tp.world_size > 1:
            t = self.tp.all_reduce(t)
        lora_expand(t, self.lora_b, self.slot_cols, batch, y)
        return y
