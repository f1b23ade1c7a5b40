"""The tool-call parsers on plain strings: hermes and llama3_json, whole outputs and the hold-back
point used while streaming."""
import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser


def test_hermes_extracts_calls_and_content():
    p = get_tool_parser("hermes")
    text = ('Checking. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {"s": "x"}}\n</tool_call>')
    content, calls = p.extract(text)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {"s": "x"})]
    assert p.extract("no calls here") == ("no calls here", [])
    assert p.extract('<tool_call>{"name": "f", "arguments": {"a": </tool_call>') == (
        '<tool_call>{"name": "f", "arguments": {"a": </tool_call>', [])  # malformed: left as text
    assert p.extract('<tool_call>{"name": "f", "arguments": {}}')[1][0].name == "f"  # unterminated last call


def test_hermes_hold_back_while_streaming():
    p = get_tool_parser("hermes")
    assert p.hold_from("plain text") == len("plain text")
    assert p.hold_from("text <tool_") == len("text ")
    assert p.hold_from("text <tool_call>{") == len("text ")


def test_llama3_json():
    p = get_tool_parser("llama3_json")
    content, calls = p.extract('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", "{}")]
    assert p.extract('<|python_tag|>{"name": "f", "parameters": {}}')[1][0].name == "f"
    assert p.extract("Hello there") == ("Hello there", [])
    assert p.extract('{"not": "a call"}') == ('{"not": "a call"}', [])
    assert p.hold_from("  {") == 2 and p.hold_from("Hello") == 5 and p.hold_from("<|py") == 0


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("mistral")
