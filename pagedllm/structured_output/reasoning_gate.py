"""The reasoning a constraint waits out (``StructuredOutputsParams.reasoning_tags``): a thinking
model writes ``<think> ... </think>`` before its answer, and the grammar applies to the answer
only. Until the end tag's token ids have appeared in the output the request is not masked and its
tokens are not given to its matcher; the tokens after the end tag are the matcher's first. When
the prompt already closed the reasoning (its last tag is an end tag: a template that turned
thinking off), there is no gate and the grammar applies from the first token."""
from __future__ import annotations

from typing import Optional, Sequence


def _last_index(ids: Sequence[int], sub: tuple[int, ...]) -> int:
    """Where ``sub`` last starts in ``ids`` (-1: nowhere)."""
    n = len(sub)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i:i + n]) == sub:
            return i
    return -1


def prompt_closes_reasoning(prompt_ids: Sequence[int], start_ids: tuple[int, ...], end_ids: tuple[int, ...]) -> bool:
    """Whether the prompt's last reasoning tag is an end tag."""
    end = _last_index(prompt_ids, end_ids)
    return end >= 0 and end > _last_index(prompt_ids, start_ids)


class ReasoningGate:
    """One request's output before its reasoning's end tag (``end_ids``: the tag's token ids)."""

    __slots__ = ("end_ids", "tail")

    def __init__(self, end_ids: tuple[int, ...]) -> None:
        self.end_ids = end_ids
        self.tail: list[int] = []  # the last len(end_ids) - 1 tokens seen (a tag split across steps)

    def feed(self, tokens: Sequence[int]) -> Optional[list[int]]:
        """The tokens after the end tag if it completes within ``tokens`` (the gate opens), else
        None (still reasoning)."""
        seen = self.tail + list(tokens)
        n, offset = len(self.end_ids), len(self.tail)
        for i in range(max(0, len(seen) - len(tokens) - n + 1), len(seen) - n + 1):
            if tuple(seen[i:i + n]) == self.end_ids:
                return seen[i + n:]
        self.tail = seen[-(n - 1):] if n > 1 else []
        return None
