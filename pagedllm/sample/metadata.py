"""SamplingMetadata: one step's sampling parameters as batched tensors (built once per step)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingMetadata:
    all_greedy: bool
    greedy_rows: Optional[torch.Tensor]  # bool [B] (None when all rows are random)
    temperature: Optional[torch.Tensor]  # float [B]; 1.0 for greedy rows
    top_k: Optional[torch.Tensor]  # long [B]; vocab size = disabled
    top_p: Optional[torch.Tensor]  # float [B]
    min_p: Optional[torch.Tensor]  # float [B]
    generators: dict[int, torch.Generator]  # row -> per-request generator (seeded requests)
    # (row, token, bias) triples for logit_bias, and (row, token) pairs to forbid (min_tokens)
    bias_rows: Optional[torch.Tensor]
    bias_cols: Optional[torch.Tensor]
    bias_vals: Optional[torch.Tensor]
    ban_rows: Optional[torch.Tensor]
    ban_cols: Optional[torch.Tensor]
    # penalties
    presence: Optional[torch.Tensor]  # float [B]
    frequency: Optional[torch.Tensor]
    repetition: Optional[torch.Tensor]
    output_counts: Optional[torch.Tensor]  # [B, V] counts of generated tokens
    prompt_mask: Optional[torch.Tensor]  # [B, V] bool: token appears in the prompt
    max_num_logprobs: Optional[int]  # None: no request wants logprobs
