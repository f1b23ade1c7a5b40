"""Worker-side per-request state, kept across steps so the scheduler only sends diffs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: Optional[torch.Generator] = None
    prompt_token_mask: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def build_block_table(states: list[CachedRequestState]) -> np.ndarray:
    width = max(len(s.block_ids) for s in states)
    table = np.zeros((len(states), width), dtype=np.int32)
    for i, s in enumerate(states):
        table[i, : len(s.block_ids)] = s.block_ids
    return table


def build_sampling_metadata(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """One SamplingMetadata for the rows being sampled this step (in row order)."""
    sps = [s.sampling_params for s in states]
    B = len(sps)
    greedy = [sp.is_greedy for sp in sps]
    all_greedy = all(greedy)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    temperature = top_k = top_p = min_p = greedy_rows = None
    generators: dict[int, torch.Generator] = {}
    if not all_greedy:
        if any(greedy):
            greedy_rows = tensor(greedy, torch.bool)
        temps = [1.0 if g else sp.temperature for g, sp in zip(greedy, sps)]
        if any(t != 1.0 for t in temps):
            temperature = tensor(temps, torch.float32)
        if any(sp.top_k > 0 for sp in sps):
            top_k = tensor([min(sp.top_k, vocab_size) if sp.top_k > 0 else vocab_size for sp in sps], torch.long)
        if any(sp.top_p < 1.0 for sp in sps):
            top_p = tensor([sp.top_p for sp in sps], torch.float32)
        if any(sp.min_p > 0.0 for sp in sps):
            min_p = tensor([sp.min_p for sp in sps], torch.float32)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None and not greedy[i]}

    bias_rows = bias_cols = bias_vals = None
    rows, cols, vals = [], [], []
    for i, sp in enumerate(sps):
        if sp.logit_bias:
            for tok, b in sp.logit_bias.items():
                if tok < vocab_size:
                    rows.append(i)
                    cols.append(tok)
                    vals.append(b)
    if rows:
        bias_rows, bias_cols, bias_vals = tensor(rows, torch.long), tensor(cols, torch.long), tensor(vals, torch.float32)

    ban_rows = ban_cols = None
    rows, cols = [], []
    for i, (s, sp) in enumerate(zip(states, sps)):
        if sp.min_tokens and s.num_output_tokens < sp.min_tokens:
            for tok in sp._all_stop_token_ids:
                if tok < vocab_size:
                    rows.append(i)
                    cols.append(tok)
    if rows:
        ban_rows, ban_cols = tensor(rows, torch.long), tensor(cols, torch.long)

    presence = frequency = repetition = output_counts = prompt_mask = None
    if any(sp.uses_penalties for sp in sps):
        output_counts = torch.zeros(B, vocab_size, dtype=torch.float32, device=device)
        prompt_mask = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
        for i, s in enumerate(states):
            if not s.sampling_params.uses_penalties:
                continue
            out = s.token_ids[s.num_prompt_tokens :]
            if out:
                ids = torch.tensor(out, dtype=torch.long, device=device)
                output_counts[i].index_add_(0, ids, torch.ones(len(out), device=device))
            if s.prompt_token_mask is None:
                s.prompt_token_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
                s.prompt_token_mask[torch.tensor(s.token_ids[: s.num_prompt_tokens], dtype=torch.long, device=device)] = True
            prompt_mask[i] = s.prompt_token_mask
        if any(sp.presence_penalty for sp in sps):
            presence = tensor([sp.presence_penalty for sp in sps], torch.float32)
        if any(sp.frequency_penalty for sp in sps):
            frequency = tensor([sp.frequency_penalty for sp in sps], torch.float32)
        if any(sp.repetition_penalty != 1.0 for sp in sps):
            repetition = tensor([sp.repetition_penalty for sp in sps], torch.float32)

    ks = [sp.logprobs for sp in sps if sp.logprobs is not None]
    return SamplingMetadata(
        all_greedy=all_greedy,
        greedy_rows=greedy_rows,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generators=generators,
        bias_rows=bias_rows,
        bias_cols=bias_cols,
        bias_vals=bias_vals,
        ban_rows=ban_rows,
        ban_cols=ban_cols,
        presence=presence,
        frequency=frequency,
        repetition=repetition,
        output_counts=output_counts,
        prompt_mask=prompt_mask,
        max_num_logprobs=max(ks) if ks else None,
    )
