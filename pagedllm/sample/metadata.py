"""SamplingMetadata: one step's sampling parameters as batched tensors, and its builder.

``build_sampling_metadata`` runs once per step on the sampling rank, over the rows that sample.
It loops over requests (and over a request's logit-bias entries / stop ids), never over the
vocabulary or the generated tokens one at a time; parameters nobody uses stay None, so an
all-greedy batch builds no tensor at all.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Optional, Protocol, Sequence

import torch

from pagedllm.sampling_params import SamplingParams


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
    # every (row, token) a penalised row has seen (prompt or output; unique pairs) and the token's
    # count among the row's outputs: sparse, so the cost follows the tokens seen, not the vocabulary
    seen_rows: Optional[torch.Tensor]  # long [S]
    seen_cols: Optional[torch.Tensor]  # long [S]
    seen_output_counts: Optional[torch.Tensor]  # float [S]
    max_num_logprobs: Optional[int]  # None: no request wants logprobs
    top_k_max: Optional[int] = None  # max of top_k (host side): below the vocab size, no full sort
    # structured outputs: the rows with an allowed-token bitmask (ascending) and their bitmasks
    mask_rows: Optional[torch.Tensor] = None  # long [M]
    mask_bits: Optional[torch.Tensor] = None  # int32 [M, ceil(vocab / 32)] (xgrammar's layout)
    # allowed_token_ids: (row, token) pairs of the only tokens those rows may take, and the rows
    allow_rows: Optional[torch.Tensor] = None  # long [A] (one per pair)
    allow_cols: Optional[torch.Tensor] = None  # long [A]
    allow_row_ids: Optional[torch.Tensor] = None  # long [R]: the distinct rows
    # offline logits processors: (row, processors, prompt token ids, output token ids)
    processors: Optional[list] = None
    # --logits-processors: the sampling rank's BatchProcessors (sample/logits_processors.py)
    batch_processors: Optional[object] = None


class SamplingRowState(Protocol):
    """What the builder reads from a request's state (the worker's CachedRequestState)."""

    token_ids: list[int]  # prompt then output tokens
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: Optional[torch.Generator]  # the request's own stream when it is seeded
    prompt_unique_ids: Optional[torch.Tensor]  # the prompt's distinct token ids, cached here on first use (penalties)

    @property
    def num_output_tokens(self) -> int: ...


# SamplingParams fields that change nothing a greedy row's sampling metadata holds (the token is the
# argmax whatever they are; stops are the scheduler's, constraints attach their masks afterwards).
# Any other field at a value other than its default (a parameter added later included) sends the
# row through build_sampling_metadata.
_NOT_SAMPLING = {"n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
                 "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "prompt_logprobs",
                 "skip_special_tokens", "spaces_between_special_tokens", "structured_outputs", "guided_decoding",
                 "_all_stop_token_ids", "truncate_prompt_tokens", "detokenize", "extra_args"}
_SAMPLING_DEFAULTS = [(f.name, f.default if f.default is not MISSING else f.default_factory())
                      for f in fields(SamplingParams) if f.name not in _NOT_SAMPLING]


def is_plain_greedy(sp: SamplingParams) -> bool:
    """Greedy with nothing else to build per row (no bias, min_tokens, penalties, logprobs, ...):
    a batch of only such rows samples with ``greedy_metadata()``. Decided once per request."""
    return sp.is_greedy and all(getattr(sp, name) == default for name, default in _SAMPLING_DEFAULTS)


def greedy_metadata() -> SamplingMetadata:
    """The metadata of a batch of plain greedy rows (``is_plain_greedy``): argmax, nothing built."""
    return SamplingMetadata(all_greedy=True, greedy_rows=None, temperature=None, top_k=None, top_p=None, min_p=None,
                            generators={}, bias_rows=None, bias_cols=None, bias_vals=None, ban_rows=None,
                            ban_cols=None, presence=None, frequency=None, repetition=None, seen_rows=None,
                            seen_cols=None, seen_output_counts=None, max_num_logprobs=None)


def build_sampling_metadata(
    states: Sequence[SamplingRowState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """One SamplingMetadata for the rows being sampled this step (in row order)."""
    sps = [s.sampling_params for s in states]
    greedy = [sp.is_greedy for sp in sps]
    all_greedy = all(greedy)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    temperature = top_k = top_p = min_p = greedy_rows = top_k_max = None
    generators: dict[int, torch.Generator] = {}
    if not all_greedy:
        if any(greedy):
            greedy_rows = tensor(greedy, torch.bool)
        temps = [1.0 if g else sp.temperature for g, sp in zip(greedy, sps)]
        if any(t != 1.0 for t in temps):
            temperature = tensor(temps, torch.float32)
        if any(sp.top_k > 0 for sp in sps):
            # greedy rows take the argmax whatever their k: 1 keeps them from forcing a full sort
            row_ks = [1 if g else min(sp.top_k, vocab_size) if sp.top_k > 0 else vocab_size for g, sp in zip(greedy, sps)]
            top_k, top_k_max = tensor(row_ks, torch.long), max(row_ks)
        if any(sp.top_p < 1.0 for sp in sps):
            top_p = tensor([sp.top_p for sp in sps], torch.float32)
        if any(sp.min_p > 0.0 for sp in sps):
            min_p = tensor([sp.min_p for sp in sps], torch.float32)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None and not greedy[i]}

    bias_rows, bias_cols, bias_vals = _logit_bias(sps, vocab_size, tensor)
    ban_rows, ban_cols = _min_tokens_bans(states, vocab_size, tensor)
    ban_rows, ban_cols = _bad_word_bans(states, vocab_size, tensor, ban_rows, ban_cols)
    allow_rows, allow_cols, allow_row_ids = _allowed_tokens(sps, vocab_size, tensor)
    processors = [(i, s.sampling_params.logits_processors, s.token_ids[: s.num_prompt_tokens],
                   s.token_ids[s.num_prompt_tokens:]) for i, s in enumerate(states) if s.sampling_params.logits_processors]
    presence, frequency, repetition, seen_rows, seen_cols, seen_counts = _penalties(states, vocab_size, device, tensor)

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
        seen_rows=seen_rows,
        seen_cols=seen_cols,
        seen_output_counts=seen_counts,
        max_num_logprobs=max(ks) if ks else None,
        top_k_max=top_k_max,
        allow_rows=allow_rows,
        allow_cols=allow_cols,
        allow_row_ids=allow_row_ids,
        processors=processors or None,
    )


def _bad_word_bans(states, vocab_size, tensor, ban_rows, ban_cols):
    """The min_tokens bans plus bad_words': a one-token word always, a longer word's last token
    when the output ends with the rest of it (vLLM's rule). A loop over the rows' words, never
    over the vocabulary."""
    rows, cols = [], []
    for i, s in enumerate(states):
        words = s.sampling_params._bad_words_token_ids
        if not words:
            continue
        out = s.token_ids[s.num_prompt_tokens:]
        for ids in words:
            head = ids[:-1]
            if ids[-1] < vocab_size and (not head or (len(out) >= len(head) and out[len(out) - len(head):] == head)):
                rows.append(i)
                cols.append(ids[-1])
    if not rows:
        return ban_rows, ban_cols
    r, c = tensor(rows, torch.long), tensor(cols, torch.long)
    if ban_rows is None:
        return r, c
    return torch.cat([ban_rows, r]), torch.cat([ban_cols, c])


def _allowed_tokens(sps, vocab_size, tensor):
    """(rows, tokens, distinct rows) of allowed_token_ids, or three Nones."""
    rows, cols, row_ids = [], [], []
    for i, sp in enumerate(sps):
        if sp.allowed_token_ids:
            ids = [t for t in sp.allowed_token_ids if t < vocab_size]
            rows.extend([i] * len(ids))
            cols.extend(ids)
            row_ids.append(i)
    if not row_ids:
        return None, None, None
    return tensor(rows, torch.long), tensor(cols, torch.long), tensor(row_ids, torch.long)


def _logit_bias(sps, vocab_size, tensor):
    """(rows, tokens, biases) of every logit_bias entry inside the vocabulary, or three Nones."""
    rows, cols, vals = [], [], []
    for i, sp in enumerate(sps):
        if sp.logit_bias:
            for tok, b in sp.logit_bias.items():
                if tok < vocab_size:
                    rows.append(i)
                    cols.append(tok)
                    vals.append(b)
    if not rows:
        return None, None, None
    return tensor(rows, torch.long), tensor(cols, torch.long), tensor(vals, torch.float32)


def _min_tokens_bans(states, vocab_size, tensor):
    """(rows, tokens) of the stop tokens forbidden until a request has its min_tokens, or Nones."""
    rows, cols = [], []
    for i, s in enumerate(states):
        sp = s.sampling_params
        if sp.min_tokens and s.num_output_tokens < sp.min_tokens:
            for tok in sp.all_stop_token_ids:
                if tok < vocab_size:
                    rows.append(i)
                    cols.append(tok)
    if not rows:
        return None, None
    return tensor(rows, torch.long), tensor(cols, torch.long)


def _penalties(states, vocab_size, device, tensor):
    """(presence, frequency, repetition, seen_rows, seen_cols, seen_output_counts); Nones if unused.

    Per penalised row: the distinct tokens of its prompt (cached on the state) and of its output
    with their counts, merged into unique (row, token) pairs. The work is proportional to the
    tokens the row holds, never to the vocabulary (a dense [B, V] rebuild each step cost a batch
    of 32 x 32000 about as much as the forward pass of a small model)."""
    sps = [s.sampling_params for s in states]
    if not any(sp.uses_penalties for sp in sps):
        return (None,) * 6
    rows, cols, counts = [], [], []
    for i, s in enumerate(states):
        if not s.sampling_params.uses_penalties:
            continue
        if s.prompt_unique_ids is None:
            prompt = torch.tensor(s.token_ids[: s.num_prompt_tokens], dtype=torch.long, device=device)
            s.prompt_unique_ids = torch.unique(prompt[prompt < vocab_size])
        ids = s.prompt_unique_ids
        n = torch.zeros(len(ids), dtype=torch.float32, device=device)
        out = s.token_ids[s.num_prompt_tokens :]
        if out:
            out_ids, out_n = torch.unique(torch.tensor(out, dtype=torch.long, device=device), return_counts=True)
            ids, inverse = torch.unique(torch.cat([ids, out_ids]), return_inverse=True)
            n = torch.zeros(len(ids), dtype=torch.float32, device=device).index_add_(
                0, inverse, torch.cat([n, out_n.to(torch.float32)]))
        rows.append(torch.full((len(ids),), i, dtype=torch.long, device=device))
        cols.append(ids)
        counts.append(n)
    presence = tensor([sp.presence_penalty for sp in sps], torch.float32) if any(sp.presence_penalty for sp in sps) else None
    frequency = tensor([sp.frequency_penalty for sp in sps], torch.float32) if any(sp.frequency_penalty for sp in sps) else None
    repetition = (tensor([sp.repetition_penalty for sp in sps], torch.float32)
                  if any(sp.repetition_penalty != 1.0 for sp in sps) else None)
    return presence, frequency, repetition, torch.cat(rows), torch.cat(cols), torch.cat(counts)
