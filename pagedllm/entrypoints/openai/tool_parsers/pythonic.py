"""Pythonic tool calls: the output is a Python list of calls with literal keyword arguments,
``[get_weather(city="Verona", unit="c"), add(a=1, b=2)]`` (Llama 3.2 / ToolACE's format; Llama 4
wraps it in ``<|python_start|>`` ... ``<|python_end|>``). Read with ``ast`` (no code runs): an
argument that is not a literal makes the whole output plain content."""
from __future__ import annotations

import ast
import json
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser, partial_prefix_at


def _call(node) -> Optional[ParsedToolCall]:
    if not isinstance(node, ast.Call) or node.args:
        return None
    func = node.func
    name = func.id if isinstance(func, ast.Name) else None
    if isinstance(func, ast.Attribute):  # a dotted name: ns.fn
        parts = []
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        if isinstance(func, ast.Name):
            name = ".".join([func.id, *reversed(parts)])
    if name is None:
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None
    if len(args) != len(node.keywords):
        return None
    return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))


def pythonic_calls(body: str) -> Optional[list[ParsedToolCall]]:
    try:
        tree = ast.parse(body.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    items = tree.body.elts if isinstance(tree.body, (ast.List, ast.Tuple)) else [tree.body]
    calls = [_call(n) for n in items]
    return calls if calls and all(c is not None for c in calls) else None


class PythonicToolParser(ToolParser):
    START: Optional[str] = None
    END: Optional[str] = None

    def extract(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        body = text.strip()
        if self.START and body.startswith(self.START):
            body = body[len(self.START):]
            if self.END and self.END in body:
                body = body[: body.index(self.END)]
        body = body.strip()
        if not body.startswith("["):
            return text, []
        calls = pythonic_calls(body)
        return (None, calls) if calls else (text, [])

    def hold_from(self, text: str) -> int:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if not stripped or stripped.startswith("["):
            return lead
        if self.START and (stripped.startswith(self.START) or partial_prefix_at(stripped, self.START) == 0):
            return lead
        return len(text)  # plain content: a call list can only open the output


class Llama4PythonicToolParser(PythonicToolParser):
    START, END = "<|python_start|>", "<|python_end|>"
