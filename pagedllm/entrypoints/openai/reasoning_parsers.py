"""Reasoning parsers (``--reasoning-parser``): a thinking model's reasoning, written between
``<think>`` and ``</think>``, comes back as ``reasoning_content`` beside the ``content`` (in chat
messages and streamed deltas), as vLLM does.

- ``deepseek_r1``: the output is reasoning from its first token (DeepSeek-R1's template opens
  ``<think>`` in the prompt; a ``<think>`` the model writes itself is dropped) up to ``</think>``;
  without ``</think>`` (cut short) it is all reasoning.
- ``qwen3``: reasoning only when the output opens with ``<think>`` (Qwen3 writes it when thinking,
  and its template closes an empty one when ``enable_thinking`` is false); otherwise all content.

Whole and streamed outputs split the same way: streaming holds back what may be the start of a tag.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.base import partial_prefix_at

_START, _END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    opens_in_prompt: bool  # reasoning from the first token (deepseek_r1) or only after <think> (qwen3)

    @property
    def tags(self) -> tuple[str, str]:
        """The reasoning's (start, end) tags: an output constraint applies after the end tag."""
        return _START, _END

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning or None, content or None) of a whole output."""
        body = text.lstrip()
        if body.startswith(_START):
            body = body[len(_START):]
        elif not self.opens_in_prompt:
            return None, text
        reasoning, sep, content = body.partition(_END)
        reasoning = reasoning if reasoning.strip() else None  # an empty think block is no reasoning
        if not sep:
            return reasoning, None
        return reasoning, content.lstrip("\n") or None


REASONING_PARSERS = {"deepseek_r1": ReasoningParser(True), "qwen3": ReasoningParser(False)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}, got {name!r}") from None


class ReasoningStream:
    """One choice's stream: text deltas in, (reasoning delta, content delta) out, split as
    ``extract`` splits the whole text."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0  # characters of the reasoning sent
        self.sent_content = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self.text += delta
        text = self.text
        body = text.lstrip()
        if not finished:
            if not body or (_START.startswith(body) and len(body) < len(_START)):
                return "", ""  # may still become <think>
        opened = body.startswith(_START)
        if not opened and not self.parser.opens_in_prompt:
            return "", self._content(text, finished)
        start = len(text) - len(body) + (len(_START) if opened else 0)
        end = text.find(_END, start)
        if end < 0:
            stop = len(text) if finished else partial_prefix_at(text, _END)
            return self._reasoning(text[start:stop]), ""
        reasoning = self._reasoning(text[start:end])
        rest = text[end + len(_END):]
        lead = len(rest) - len(rest.lstrip("\n"))
        if not finished and not rest.lstrip("\n"):
            return reasoning, ""  # the newlines after </think> are not content (as extract)
        return reasoning, self._content(rest[lead:], finished)

    def _reasoning(self, full: str) -> str:
        if not full.strip():
            return ""  # whitespace alone is held back: it may stay an empty think block
        out = full[self.sent_reasoning:]
        self.sent_reasoning = len(full)
        return out

    def _content(self, full: str, finished: bool) -> str:
        out = full[self.sent_content:]
        self.sent_content = len(full)
        return out
