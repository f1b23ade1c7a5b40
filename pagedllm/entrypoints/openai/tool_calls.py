"""Tool calling in chat completions: what ``tools`` / ``tool_choice`` make of a request, and how
the generated text becomes OpenAI ``tool_calls`` (whole, or as streamed deltas).

- ``none`` (the default without tools): free text; the tools are not shown to the template.
- ``auto`` (the default with tools, as OpenAI): needs ``--enable-auto-tool-choice`` and a
  ``--tool-call-parser`` (hermes, llama3_json), as vLLM; the model writes its own tool-call
  format and the parser reads it out; finish_reason "tool_calls" when it called one.
- ``required``: the output is grammar-constrained to a JSON array of ``{"name": ...,
  "parameters": {...}}`` objects, one per call, each name one of the tools and its parameters
  valid for that tool's JSON schema (one call at most when ``parallel_tool_calls`` is false);
  finish_reason "tool_calls".
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained to that function's parameters schema and is its arguments; finish_reason "stop",
  as OpenAI answers a forced function.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pagedllm.entrypoints.openai.protocol import (
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall,
)
from pagedllm.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser, get_tool_parser
from pagedllm.sampling_params import StructuredOutputsParams

_EMPTY_PARAMS = {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    mode: str = "none"  # none | auto | required | named
    tools: Optional[list[dict[str, Any]]] = None  # shown to the chat template (OpenAI's shape)
    constraint: Optional[StructuredOutputsParams] = None
    parser: Optional[ToolParser] = None
    named: Optional[str] = None

    @property
    def active(self) -> bool:
        return self.mode != "none"


def plan_tools(req, enable_auto_tool_choice: bool, tool_call_parser: Optional[str],
               error: Callable[[str, str], Exception]) -> ToolPlan:
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise error("tool_choice needs tools", "tool_choice")
        return ToolPlan()  # parallel_tool_calls without tools: accepted, nothing to call (as vLLM)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise error("tools: function names must be unique", "tools")
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    params = {t.function.name: t.function.parameters or _EMPTY_PARAMS for t in tools}
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        if not enable_auto_tool_choice or not tool_call_parser:
            raise error('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                        "--tool-call-parser; use \"required\", a named function or \"none\"",
                        "tool_choice")
        return ToolPlan("auto", rendered, None, get_tool_parser(tool_call_parser, rendered))
    if choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": [n]}, "parameters": params[n]},
             "required": ["name", "parameters"], "additionalProperties": False} for n in names]}}
        if req.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return ToolPlan("required", rendered, StructuredOutputsParams(json=calls))
    name = choice.function.name
    if name not in params:
        raise error(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
    return ToolPlan("named", rendered, StructuredOutputsParams(json=params[name]), named=name)


def template_message(m, content: str) -> dict[str, Any]:
    """One request message as the chat template sees it (tool calls with their arguments as
    objects, as Hugging Face templates expect; a tool result with its call id)."""
    d: dict[str, Any] = {"role": m.role, "content": content}
    if m.name:
        d["name"] = m.name
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except ValueError:
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
        d["tool_calls"] = calls
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def parse_output(plan: ToolPlan, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
    """(content, tool calls) of a finished output."""
    if plan.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []  # cut short (length): not a call
        return None, [ParsedToolCall(plan.named, text)]
    if plan.mode == "required":
        items = complete_array_items(text)
        if not items:
            return text, []
        return None, [ParsedToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
    if plan.mode == "auto":
        return plan.parser.extract(text)
    return text, []


def complete_array_items(text: str) -> list[Any]:
    """The complete objects of a JSON array's text, which may be cut short (max_tokens): the
    calls written in full before the cut are calls, the one cut off is dropped."""
    decoder, items = json.JSONDecoder(), []
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        return items
    i += 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return items
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return items
        if not isinstance(obj, dict) or "name" not in obj or "parameters" not in obj:
            return items
        items.append(obj)


def finish_reason(plan: ToolPlan, calls: list, reason: Optional[str]) -> Optional[str]:
    if calls and reason == "stop" and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def tool_calls(calls: list[ParsedToolCall]) -> list[ToolCall]:
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


@dataclass
class ToolStream:
    """One choice's stream under a tool plan: text deltas in, DeltaMessages out. A named
    function streams its arguments as they come; required and auto hold back what may be a
    call and send the calls (name first, then the arguments) when the output ends."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of ``text`` sent as content
    started: bool = False
    calls: list = field(default_factory=list)

    def feed(self, delta: str, finished: bool) -> list[DeltaMessage]:
        self.text += delta
        plan, out = self.plan, []
        if plan.mode == "named":
            if not self.started:
                self.started = True
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=0, id=new_call_id(), type="function",
                                                                  function=DeltaFunctionCall(name=plan.named,
                                                                                             arguments=""))]))
            if delta:
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]))
            if finished:
                self.calls = parse_output(plan, self.text)[1]
            return out
        hold = 0
        if plan.mode == "auto":  # whitespace before a call is not content (as extract() strips it)
            hold = len(self.text[:plan.parser.hold_from(self.text)].rstrip())
        _, calls = parse_output(plan, self.text) if finished else (None, [])
        if (not finished or calls) and hold > self.sent:  # the content before a call
            out.append(DeltaMessage(content=self.text[self.sent:hold]))
            self.sent = hold
        if not finished:
            return out
        self.calls = calls
        if not self.calls:
            if len(self.text) > self.sent:
                out.append(DeltaMessage(content=self.text[self.sent:]))
                self.sent = len(self.text)
            return out
        for i, c in enumerate(self.calls):
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=new_call_id(), type="function",
                                                              function=DeltaFunctionCall(name=c.name, arguments=""))]))
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=c.arguments))]))
        return out
