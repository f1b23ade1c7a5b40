"""Tool-call parsers for tool_choice "auto" (``--tool-call-parser``): each reads a model's own
tool-call format out of its generated text."""
from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {name!r}") from None


__all__ = ["ParsedToolCall", "ToolParser", "TOOL_PARSERS", "get_tool_parser"]
