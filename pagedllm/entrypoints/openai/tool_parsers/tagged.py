"""Tool-call formats with their own tags: Qwen3-Coder's XML-like calls and DeepSeek-V3's
special-token calls. Text before the first call is content."""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall, ToolParser, call_from_object, partial_prefix_at)

_QWEN_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|$)", re.DOTALL)
_QWEN_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    """``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...</function>\\n</tool_call>``:
    each value is text, typed by the tool's JSON schema where the request gave one (numbers,
    booleans, objects and arrays parsed as JSON; strings kept as written), else parsed as JSON
    when it is JSON."""

    START = "<tool_call>"

    def __init__(self, tools: Optional[list[dict[str, Any]]] = None) -> None:
        self.schemas = {}
        for t in tools or []:
            fn = t.get("function", t)
            self.schemas[fn.get("name")] = (fn.get("parameters") or {}).get("properties", {})

    def _value(self, fn: str, key: str, raw: str) -> Any:
        kind = (self.schemas.get(fn, {}).get(key) or {}).get("type")
        if kind == "string":
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            if kind in (None, "string"):
                return raw
            lowered = raw.strip().lower()
            if kind == "boolean" and lowered in ("true", "false"):
                return lowered == "true"
            return raw

    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        i = text.find(self.START)
        if i < 0:
            return text, []
        calls = []
        for m in _QWEN_CALL.finditer(text, i):
            name = m.group(1).strip()
            args = {k.strip(): self._value(name, k.strip(), v) for k, v in _QWEN_PARAM.findall(m.group(2))}
            calls.append(ParsedToolCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        return text[:i].rstrip() or None, calls

    def hold_from(self, text: str) -> int:
        i = text.find(self.START)
        return i if i >= 0 else partial_prefix_at(text, self.START)


_DS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)\n```(?:json)?\n(.*?)\n```\s*<｜tool▁call▁end｜>",
                      re.DOTALL)


class DeepSeekV3ToolParser(ToolParser):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``."""

    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        i = text.find(_DS_BEGIN)
        if i < 0:
            return text, []
        calls = []
        for _, name, args in _DS_CALL.findall(text, i):
            try:
                call = call_from_object({"name": name.strip(), "arguments": json.loads(args)})
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        return text[:i].rstrip() or None, calls

    def hold_from(self, text: str) -> int:
        i = text.find(_DS_BEGIN)
        return i if i >= 0 else partial_prefix_at(text, _DS_BEGIN)
