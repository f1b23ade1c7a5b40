"""What a tool-call parser gives back, and the base class of every parser."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's function.arguments


class ToolParser:
    """The base of every tool-call parser: ``extract`` and ``hold_from``."""

    # its markers are special tokens: the server decodes with skip_special_tokens off while tools
    # are active (as vLLM's parsers adjust the request)
    KEEPS_SPECIAL_TOKENS = False

    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        """(the content left once the tool calls are taken out, or None; the tool calls). Text
        with no well-formed tool call comes back whole as content, with no calls. The content
        before a call keeps its leading whitespace and loses its trailing whitespace (streaming
        holds whitespace back until more text comes, so both give the same content)."""
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """While streaming: the index in ``text`` from which the output may be a tool call (not
        streamed as content until the output ends); len(text) when none can start yet."""
        raise NotImplementedError


def call_from_object(obj: Any) -> Optional[ParsedToolCall]:
    """A tool call from ``{"name": ..., "arguments"|"parameters": {...}}``, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def partial_prefix_at(text: str, marker: str) -> int:
    """The index where ``text`` ends with a proper prefix of ``marker`` (it may become the
    marker), or len(text)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)
