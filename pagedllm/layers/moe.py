"""Mixture of experts: a router (top-k over softmax or sigmoid scores) and grouped experts.

Expert weights are stacked at load, one ``[E, ...]`` tensor per projection: ``w13``
``[E, 2 * I / tp, H]`` (each expert's gate rows, then its up rows) and ``w2`` ``[E, H, I / tp]``.
Tensor parallelism splits every expert's intermediate dimension; the down products' partial
sums meet in one all-reduce per layer.

The forward pass never loops over tokens: the step's ``T * top_k`` (token, expert) pairs are
sorted by expert (one stable argsort), the hidden rows gathered once in that order, and each
expert that received tokens runs its two products over its contiguous run of rows (a loop over
experts with tokens, at most E per layer: an expert nobody picked costs nothing, so step time
grows with the active experts, not the total). The weighted rows are summed back into their
tokens with one ``index_add_``.

Routing (``RouterConfig``), as each family's config says:
- softmax: softmax over all experts (float32), top-k, renormalised over the k when
  ``renormalize`` (Mixtral always; Qwen MoE per ``norm_topk_prob``);
- sigmoid (DeepSeek-V3): sigmoid scores; the choice uses score + ``e_score_correction_bias``,
  restricted to the ``topk_groups`` best of ``num_groups`` expert groups (a group's score is
  the sum of its two best); the weights are the chosen experts' plain scores, renormalised
  when asked, times ``scaling_factor``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.cpu_gemm import linear, pack_linear_weights
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear, _attach, default_weight_loader, materialize


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE scoring {self.scoring!r} (supported: softmax, sigmoid)")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in 1..num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"expert groups: {self.num_experts} experts, n_group {self.num_groups}, "
                             f"topk_group {self.topk_groups}")


def select_experts(logits: torch.Tensor, cfg: RouterConfig,
                   correction_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    logits = logits.float()
    if cfg.scoring == "softmax":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), cfg.top_k, dim=-1)
        if cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * cfg.scaling_factor if cfg.scaling_factor != 1.0 else weights, ids
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups > 1:
        T = choice.shape[0]
        grouped = choice.view(T, cfg.num_groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, cfg.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.scaling_factor, ids


class Router(nn.Module):
    """``weight`` [E, H] (and DeepSeek-V3's ``e_score_correction_bias``): hidden -> (weights, ids)."""

    packable_weight = True  # the worker may swap the weight for a packed CPU GEMM layout

    def __init__(self, hidden: int, cfg: RouterConfig, correction_bias: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = _attach(nn.Parameter(torch.empty(cfg.num_experts, hidden), requires_grad=False),
                              default_weight_loader)
        self.e_score_correction_bias = (
            _attach(nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False),
                    default_weight_loader) if correction_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(linear(x, self.weight), self.cfg, self.e_score_correction_bias)


class GroupedExperts(nn.Module):
    """E gated-SiLU experts stacked in two tensors; returns this rank's partial sums (no all-reduce:
    the caller reduces once, after adding any shared expert's partial output)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        tp = get_tp_group()
        if intermediate % tp.world_size:
            raise ValueError(f"moe intermediate size {intermediate} is not divisible by tensor parallel size "
                             f"{tp.world_size}")
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.num_experts = num_experts
        self.inter = intermediate // tp.world_size
        self.w13_weight = _attach(nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden), requires_grad=False),
                                  self.weight_loader)
        self.w2_weight = _attach(nn.Parameter(torch.empty(num_experts, hidden, self.inter), requires_grad=False),
                                 self.weight_loader)
        self.act = SiluAndMul()
        self.packed: Optional[nn.ModuleList] = None  # per expert [w13, w2], packed for the CPU GEMM

    def pack_for_cpu(self, model_dtype: torch.dtype) -> bool:
        """After loading, on CPU: every expert's two projections packed once for the CPU GEMM (the
        layout pack_linear_weights gives dense layers; 6x oneDNN's bf16 product for a decode
        step's few rows per expert, measured single-threaded at 4 x 512 -> 2048), and the stacked
        copies freed. False (nothing changed) where no packed form exists."""
        projections = nn.ModuleList([_Projection(w[e]) for e in range(self.num_experts)
                                     for w in (self.w13_weight, self.w2_weight)])
        if pack_linear_weights(projections, model_dtype) == 0:
            return False
        self.packed = projections
        for p in (self.w13_weight, self.w2_weight):
            p.data = p.data.new_empty((0,) + tuple(p.shape[1:]))
        return True

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: tuple[int, int]) -> None:
        """``shard_id`` = (expert, 0 gate | 1 up | 2 down); loads this rank's slice of the
        intermediate dimension (rows of gate/up, columns of down)."""
        expert, which = shard_id
        n = self.inter
        if which == 2:
            piece = loaded.narrow(1, self.tp_rank * n, n) if self.tp_size > 1 else materialize(loaded)
            dest = param.data[expert]
        else:
            piece = loaded.narrow(0, self.tp_rank * n, n) if self.tp_size > 1 else materialize(loaded)
            dest = param.data[expert].narrow(0, which * n, n)
        if piece.shape != dest.shape:
            raise ValueError(f"expert {expert} projection {which}: checkpoint {tuple(loaded.shape)} does not fit "
                             f"{tuple(dest.shape)} (tp {self.tp_size})")
        dest.copy_(piece)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host read per layer
        rows = order // k  # the token of each sorted pair
        xs = x.index_select(0, rows)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            if self.packed is not None:
                w13, w2 = self.packed[2 * e].weight, self.packed[2 * e + 1].weight
            else:
                w13, w2 = self.w13_weight[e], self.w2_weight[e]
            ys[start:end] = linear(self.act(linear(xs[start:end], w13)), w2)
            start = end
        scaled = (ys * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)  # float32 weights, as HF
        return torch.zeros_like(x).index_add_(0, rows, scaled)


class _Projection(nn.Module):
    packable_weight = True

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class GatedMLP(nn.Module):
    """silu(gate) * up -> down, column/row parallel (the shared expert)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """Router + grouped experts, optionally a shared expert (always on; Qwen2-MoE gates it with
    sigmoid(shared_expert_gate(x)), DeepSeek adds it plain). Under TP the experts' partial sums
    take one all-reduce, the shared expert's down projection its own."""

    def __init__(self, hidden: int, intermediate: int, router: RouterConfig, shared_intermediate: int = 0,
                 shared_gate: bool = False, correction_bias: bool = False) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.gate = Router(hidden, router, correction_bias)
        self.experts = GroupedExperts(router.num_experts, hidden, intermediate)
        self.shared_expert = GatedMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = _SharedGate(hidden) if shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.tp.all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


class _SharedGate(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = _attach(nn.Parameter(torch.empty(1, hidden), requires_grad=False), default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")


def expert_weight_target(name: str, gate: str = "gate_proj", up: str = "up_proj",
                         down: str = "down_proj") -> Optional[tuple[str, tuple[int, int]]]:
    """A per-expert checkpoint tensor (``...experts.3.gate_proj.weight``) -> (our stacked
    parameter, (expert, shard)); None for any other name."""
    m = _EXPERT_NAME.match(name)
    if m is None:
        return None
    which = {gate: 0, up: 1, down: 2}.get(m.group("proj"))
    if which is None:
        return None
    return f"{m.group('prefix')}.{'w2' if which == 2 else 'w13'}_weight", (int(m.group("e")), which)
