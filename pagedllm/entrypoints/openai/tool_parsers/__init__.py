"""Tool-call parsers for tool_choice "auto" (``--tool-call-parser``): each reads a model's own
tool-call format out of its generated text."""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.json_array import (
    GraniteToolParser,
    InternLMToolParser,
    JambaToolParser,
    MistralToolParser,
    XLAMToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.tagged import DeepSeekV3ToolParser, Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
    "pythonic": PythonicToolParser, "llama4_pythonic": Llama4PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser, "qwen3_xml": Qwen3CoderToolParser, "deepseek_v3": DeepSeekV3ToolParser,
    "granite": GraniteToolParser, "xlam": XLAMToolParser, "internlm": InternLMToolParser, "jamba": JambaToolParser,
}


def get_tool_parser(name: str, tools: Optional[list[dict[str, Any]]] = None) -> ToolParser:
    """The parser named ``name``; ``tools`` (the request's, OpenAI's shape) for the parsers that
    type arguments by their schema (qwen3_coder)."""
    try:
        cls = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {name!r}") from None
    return cls(tools) if cls is Qwen3CoderToolParser else cls()


__all__ = ["ParsedToolCall", "ToolParser", "TOOL_PARSERS", "get_tool_parser"]
