"""Llama 3.x JSON tool calls: the output is a JSON object ``{"name": ..., "parameters": {...}}``
(or ``"arguments"``), optionally after ``<|python_tag|>``; several calls separated by ``;``."""
from __future__ import annotations

import json
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall, ToolParser, call_from_object, partial_prefix_at)

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG):].strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = call_from_object(obj)
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls

    def hold_from(self, text: str) -> int:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if not stripped:
            return 0
        if stripped.startswith("{") or stripped.startswith(_TAG):
            return lead
        if partial_prefix_at(stripped, _TAG) == 0:
            return lead
        return len(text)  # plain content: a JSON call can only open the output
