"""The tool-call parsers on plain strings: hermes and llama3_json, whole outputs and the hold-back
point used while streaming."""
import json

import pytest

from pagedllm.entrypoints.openai import tool_calls as tc
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


def _stream(plan, pieces):
    """Feed ``pieces`` to a ToolStream; (streamed content, calls)."""
    st = tc.ToolStream(plan)
    content = []
    for k, piece in enumerate(pieces):
        for d in st.feed(piece, k == len(pieces) - 1):
            if d.content:
                content.append(d.content)
    return "".join(content), st.calls


@pytest.mark.parametrize("text", [
    'Let me check. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
    '\nLet me check.\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>',
    ' <tool_call>{"name": "f", "arguments": {}}</tool_call>',
    "Just text, ending in spaces   ",
])
def test_hermes_auto_streamed_content_equals_whole(text):
    """Regression: streamed, the content before a call kept its trailing space."""
    plan = tc.ToolPlan("auto", [], None, get_tool_parser("hermes"))
    whole, calls = tc.parse_output(plan, text)
    for size in (1, 3, len(text)):
        streamed, scalls = _stream(plan, [text[i:i + size] for i in range(0, len(text), size)])
        assert streamed == (whole or "") and scalls == calls


def test_required_calls_cut_by_max_tokens_keep_the_complete_ones():
    """Regression: tool_choice "required" output cut at max_tokens after complete calls gave []."""
    plan = tc.ToolPlan("required", [], None)
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"s": "x"}}, {"name": "f", "para'
    content, calls = tc.parse_output(plan, text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {"s": "x"})]
    assert tc.finish_reason(plan, calls, "length") == "length"
    assert _stream(plan, [text[:20], text[20:]])[1] == calls
    assert tc.parse_output(plan, '[{"name": "f", "par') == ('[{"name": "f", "par', [])  # none complete: text
    assert tc.parse_output(plan, "[]") == ("[]", [])


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
        get_tool_parser("no_such_parser")


WEATHER_ADD = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "number"}}}}}]
EXPECTED = [("get_weather", {"city": "Verona", "days": 2}), ("add", {"a": 1, "b": 2.5})]

# Each family's own format, as its chat template / docs write a call (two calls, text before them
# where the format allows it).
FORMATS = {
    "mistral": ('Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Verona", "days": 2}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2.5}}]', "Let me check."),
    "mistral_v11": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Verona", "days": 2}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2.5}',
                    None),
    "pythonic": ('[get_weather(city="Verona", days=2), add(a=1, b=2.5)]', None),
    "llama4_pythonic": ('<|python_start|>[get_weather(city="Verona", days=2), add(a=1, b=2.5)]<|python_end|>', None),
    "qwen3_coder": ("I will call the tools.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nVerona\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n"
                    "<parameter=a>\n1\n</parameter>\n<parameter=b>\n2.5\n</parameter>\n</function>\n</tool_call>",
                    "I will call the tools."),
    "deepseek_v3": ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Verona", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n'
                    '```json\n{"a": 1, "b": 2.5}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Checking."),
    "granite": ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Verona", "days": 2}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2.5}}]', None),
    "granite_31": ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Verona", "days": 2}}, '
                   '{"name": "add", "arguments": {"a": 1, "b": 2.5}}]', None),
    "xlam": ('[{"name": "get_weather", "arguments": {"city": "Verona", "days": 2}}, '
             '{"name": "add", "arguments": {"a": 1, "b": 2.5}}]', None),
    "internlm": ('Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Verona", '
                 '"days": 2}}<|action_end|>\n<|action_start|><|plugin|>\n{"name": "add", "parameters": {"a": 1, '
                 '"b": 2.5}}<|action_end|>', "Let me check."),
    "jamba": ('Checking the tools. <tool_calls>[{"name": "get_weather", "arguments": {"city": "Verona", "days": 2}}, '
              '{"name": "add", "arguments": {"a": 1, "b": 2.5}}]</tool_calls>', "Checking the tools."),
    "xlam_fenced": ('Sure.\n```json\n[{"name": "get_weather", "arguments": {"city": "Verona", "days": 2}}, '
                    '{"name": "add", "arguments": {"a": 1, "b": 2.5}}]\n```', "Sure."),
}


@pytest.mark.parametrize("case", sorted(FORMATS))
def test_family_formats_whole_and_streamed(case):
    name = case.split("_v11")[0].replace("_31", "").replace("_fenced", "")
    text, content = FORMATS[case]
    plan = tc.ToolPlan("auto", WEATHER_ADD, None, get_tool_parser(name, WEATHER_ADD))
    whole, calls = tc.parse_output(plan, text)
    assert whole == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    for size in (1, 4, len(text)):
        streamed, scalls = _stream(plan, [text[i:i + size] for i in range(0, len(text), size)])
        assert streamed == (content or "") and scalls == calls
    plain = "The weather in Verona is fine."  # no call: all content, streamed as it comes
    assert tc.parse_output(plan, plain) == (plain, [])
    assert _stream(plan, [plain[:9], plain[9:]]) == (plain, [])


def test_qwen3_coder_types_arguments_by_schema():
    p = get_tool_parser("qwen3_coder", WEATHER_ADD)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n<parameter=metric>\ntrue\n"
            "</parameter>\n</function>\n</tool_call>")
    assert json.loads(p.extract(text)[1][0].arguments) == {"city": "123", "metric": True}  # "string" stays text


def test_pythonic_never_runs_code():
    p = get_tool_parser("pythonic")
    text = '[get_weather(city=__import__("os").getcwd())]'
    assert p.extract(text) == (text, [])  # not a literal: plain content
    assert p.extract("[1, 2]") == ("[1, 2]", [])
