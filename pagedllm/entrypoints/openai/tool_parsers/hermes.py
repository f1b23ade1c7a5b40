"""Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number of them, text around them kept as content."""
from __future__ import annotations

import json
import re
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall, ToolParser, call_from_object, partial_prefix_at)

_START, _END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        if _START not in text:
            return text, []
        calls = []
        for body in _CALL.findall(text):
            try:
                call = call_from_object(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []  # a malformed call: the text is returned as it is
            calls.append(call)
        content = text[: text.index(_START)].rstrip()
        return (content or None), calls

    def hold_from(self, text: str) -> int:
        i = text.find(_START)
        return i if i >= 0 else partial_prefix_at(text, _START)
