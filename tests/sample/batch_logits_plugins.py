"""Batch logits processors for the --logits-processors tests (importable by qualified name:
``batch_logits_plugins:ForceToken``)."""
from __future__ import annotations

import torch

from pagedllm.sample.logits_processors import BatchUpdate, LogitsProcessor


class ForceToken(LogitsProcessor):
    """A request with ``extra_args={"force_token": T}`` can only sample T; others are untouched.
    Keeps a row -> token map from the batch updates, as a vLLM processor does."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        t = (sampling_params.extra_args or {}).get("force_token")
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ValueError(f"force_token must be a token id >= 0, got {t!r}")

    def __init__(self, config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, int] = {}
        self.updates: list[BatchUpdate] = []

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        self.updates.append(batch_update)
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, _prompt, _output in batch_update.added:
            t = (params.extra_args or {}).get("force_token")
            if t is None:
                self.rows.pop(i, None)
            else:
                self.rows[i] = t
        for i in [r for r in self.rows if r >= batch_update.batch_size]:
            del self.rows[i]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = torch.tensor(list(self.rows), dtype=torch.long)
        cols = torch.tensor(list(self.rows.values()), dtype=torch.long)
        keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = keep
        return logits


class NotAProcessor:
    pass
