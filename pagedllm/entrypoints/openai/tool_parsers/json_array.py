"""Tool calls written as a JSON array of ``{"name", "arguments"}`` objects after a marker: Mistral
(``[TOOL_CALLS][...]``, and its newer ``[TOOL_CALLS]name[ARGS]{...}``), Granite
(``<|tool_call|>[...]`` / ``<tool_call>[...]``), xLAM (a bare array, a ```json block or
``[TOOL_CALLS]``), Jamba (``<tool_calls>[...]</tool_calls>``) and InternLM2 (one
``<|action_start|><|plugin|>{"name", "parameters"}<|action_end|>`` block per call). Text before
the marker is content; an output whose calls do not parse comes back whole as content. Parsers
whose markers are special tokens set ``KEEPS_SPECIAL_TOKENS``: the server then decodes with
skip_special_tokens off while tools are active (as vLLM's parsers adjust the request)."""
from __future__ import annotations

import json
import re
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall, ToolParser, call_from_object, partial_prefix_at)


def calls_from_array(body: str) -> Optional[list[ParsedToolCall]]:
    """The calls of a JSON array (or one object) of call objects, else None."""
    try:
        value, end = json.JSONDecoder().raw_decode(body.strip())
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_from_object(v) for v in items]
    return calls if calls and all(c is not None for c in calls) else None


def _hold(text: str, markers: tuple[str, ...]) -> int:
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return min(found)
    return min(partial_prefix_at(text, m) for m in markers)


class MistralToolParser(ToolParser):
    MARKER = "[TOOL_CALLS]"
    KEEPS_SPECIAL_TOKENS = True
    _ARGS = "[ARGS]"

    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        i = text.find(self.MARKER)
        if i < 0:
            return text, []
        body = text[i + len(self.MARKER):]
        calls = calls_from_array(body) if body.lstrip().startswith(("[", "{")) else self._named(body)
        if not calls:
            return text, []
        return text[:i].rstrip() or None, calls

    def _named(self, body: str) -> Optional[list[ParsedToolCall]]:
        """``name[ARGS]{...}`` (repeated after further markers): the v11+ tokenizers' format."""
        calls = []
        for part in body.split(self.MARKER):
            name, sep, args = part.partition(self._ARGS)
            if not sep:
                return None
            try:
                obj, _ = json.JSONDecoder().raw_decode(args.strip())
            except ValueError:
                return None
            call = call_from_object({"name": name.strip(), "arguments": obj})
            if call is None:
                return None
            calls.append(call)
        return calls

    def hold_from(self, text: str) -> int:
        return _hold(text, (self.MARKER,))


class GraniteToolParser(ToolParser):
    MARKERS = ("<|tool_call|>", "<tool_call>")

    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        body = text.strip()
        for m in self.MARKERS:
            if body.startswith(m):
                body = body[len(m):]
                break
        if not body.lstrip().startswith("["):
            return text, []
        calls = calls_from_array(body)
        return (None, calls) if calls else (text, [])

    def hold_from(self, text: str) -> int:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if not stripped or stripped.startswith("[") or any(m.startswith(stripped[:len(m)]) for m in self.MARKERS):
            return lead
        return len(text)  # plain content: the calls can only open the output


_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*(?:```|$)", re.DOTALL)


class XLAMToolParser(ToolParser):
    MARKERS = ("```", "[TOOL_CALLS]", "<tool_call>")

    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        stripped = text.lstrip()
        if stripped.startswith(("[", "{")):
            calls = calls_from_array(stripped)
            return (None, calls) if calls else (text, [])
        i = text.find("```")
        if i >= 0:
            m = _FENCE.match(text, i)
            calls = calls_from_array(m.group(1)) if m else None
            return (text[:i].rstrip() or None, calls) if calls else (text, [])
        for marker, end in (("[TOOL_CALLS]", None), ("<tool_call>", "</tool_call>")):
            i = text.find(marker)
            if i >= 0:
                body = text[i + len(marker):]
                if end is not None:
                    body = body.split(end, 1)[0]
                calls = calls_from_array(body)
                return (text[:i].rstrip() or None, calls) if calls else (text, [])
        return text, []

    def hold_from(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("[", "{")):
            return len(text) - len(stripped)
        return _hold(text, self.MARKERS)


class JambaToolParser(ToolParser):
    """AI21 Jamba 1.5: ``<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>``."""

    BEGIN, END = "<tool_calls>", "</tool_calls>"
    KEEPS_SPECIAL_TOKENS = True

    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        i = text.find(self.BEGIN)
        if i < 0:
            return text, []
        body = text[i + len(self.BEGIN):].partition(self.END)[0]
        calls = calls_from_array(body)
        if not calls:
            return text, []
        return text[:i].rstrip() or None, calls

    def hold_from(self, text: str) -> int:
        return _hold(text, (self.BEGIN,))


class InternLMToolParser(ToolParser):
    """InternLM2 / 2.5 chat: ``<|action_start|><|plugin|>\n{"name": ..., "parameters": {...}}<|action_end|>``,
    one block per call."""

    BEGIN, END = "<|action_start|><|plugin|>", "<|action_end|>"
    KEEPS_SPECIAL_TOKENS = True

    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        i = text.find(self.BEGIN)
        if i < 0:
            return text, []
        calls = []
        for block in text[i:].split(self.BEGIN)[1:]:
            body, _, rest = block.partition(self.END)
            try:
                obj, end = json.JSONDecoder().raw_decode(body.strip())
            except ValueError:
                return text, []
            call = call_from_object(obj)
            if call is None or body.strip()[end:].strip() or rest.strip():
                return text, []
            calls.append(call)
        return text[:i].rstrip() or None, calls

    def hold_from(self, text: str) -> int:
        return _hold(text, (self.BEGIN,))
