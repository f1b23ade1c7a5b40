"""Vocab-parallel embedding and LM head (rows of the vocabulary split across ranks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.cpu_gemm import linear
from pagedllm.layers.linear import materialize


class VocabParallelEmbedding(nn.Module):
    packed = None  # a GGUF file's quantized table (quantization/gguf.GGUFWeight): rows dequantized on lookup

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.world_size)
        self.start = tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] < self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding shape {tuple(loaded.shape)} does not match vocab {self.vocab_size}")
        piece = loaded.narrow(0, self.start, self.end - self.start)
        param.data[: piece.shape[0]].copy_(materialize(piece))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(ids, self.weight)
        flat = self.packed.dequantize_rows(ids.reshape(-1))
        return flat.to(self.packed_dtype).reshape(*ids.shape, -1)

    packed_dtype = torch.float32  # the model's dtype, for a packed table's rows (set with ``packed``)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)
        mask = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mask, input_ids - self.start, 0)
        out = self._lookup(local)
        out = out * mask.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Computes this rank's slice of the logits and gathers the full vocabulary."""

    packable_weight = True

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__(vocab_size, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.packed is not None:
            logits = self.packed.linear(hidden)
        else:
            logits = linear(hidden, self.weight)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
