"""Structured outputs and tool calling through the server, with the official openai client, on the
default model (a real byte-level BPE tokenizer): response_format, vLLM's guided_* extras, tools
with tool_choice required / named / auto (hermes), streamed tool_calls deltas, 400s naming the
field; and every request field of the installed openai client honoured, refused or ignored."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from conftest import ENGINE_KW, LiveServer  # noqa: E402

# A template that shows tools, assistant tool calls and tool results (the default model's does not).
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}{% endif %}"
    "{% if m.get('tool_call_id') %} [{{ m['tool_call_id'] }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "maxLength": 6},
                                                 "unit": {"enum": ["c", "f"]}},
                                                 "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
MESSAGES = [{"role": "user", "content": "What is the weather in Verona?"}]


@pytest.fixture(scope="module")
def live(default_model, tmp_path_factory):
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import ServerArgs, build_app

    tpl = tmp_path_factory.mktemp("tpl") / "tools.jinja"
    tpl.write_text(TOOL_TEMPLATE)
    args = ServerArgs(chat_template=str(tpl), enable_auto_tool_choice=True, tool_call_parser="hermes")
    kw = dict(ENGINE_KW, max_model_len=1024, kv_cache_memory=64 << 20)
    app = build_app(EngineConfig(model=default_model, served_model_name="tiny", **kw), args=args)
    server = LiveServer(app)
    deadline = time.monotonic() + 120
    while server.state.serving is None:
        assert server.state.load_error is None, server.state.load_error
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield server
    server.stop()


@pytest.fixture
def client(live):
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(live, path, body):
    return httpx.post(live.url + path, json=body, timeout=120)


# ---- response_format and the guided_* extras ------------------------------------------------
def test_response_format_json_schema_chat_and_completions(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "lines": {"type": "integer", "minimum": 1, "maximum": 40},
                                               "mood": {"enum": ["grim", "merry"]}},
              "required": ["name", "lines", "mood"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "speech", "schema": schema, "strict": True}}
    for temp in (0.0, 1.0):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=rf, max_tokens=80,
                                           temperature=temp, seed=3, n=2)
        for c in r.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), schema)
    r = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=120, temperature=0.7, seed=1,
                                  extra_body={"response_format": rf})
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_parse_with_pydantic_model(client):
    from pydantic import BaseModel, Field

    class Speech(BaseModel):
        speaker: str = Field(max_length=10)
        act: int = Field(ge=1, le=5)

    r = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Speech, max_tokens=80,
                                      temperature=0.8, seed=2)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Speech) and 1 <= parsed.act <= 5


def test_guided_extras_and_structured_outputs(client):
    cases = [({"guided_regex": r"[A-Z][a-z]{2,6} [0-9]{2}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", t)),
             ({"guided_choice": ["Romeo", "Juliet"]}, lambda t: t in ("Romeo", "Juliet")),
             ({"guided_grammar": 'root ::= "act " [1-5]'}, lambda t: re.fullmatch("act [1-5]", t)),
             ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
             ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
              lambda t: isinstance(json.loads(t), list)),
             ({"response_format": {"type": "json_object"}}, None)]
    for extra, ok in cases:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=4,
                                           extra_body=extra)
        text = r.choices[0].message.content
        if ok is None:
            assert text.startswith("{")
            if r.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(text), dict)
        else:
            assert ok(text), (extra, text)


def test_response_format_structural_tag(client):
    schema = {"type": "object", "properties": {"act": {"enum": [1, 2, 3, 4, 5]}}, "required": ["act"],
              "additionalProperties": False}
    rf = {"type": "structural_tag", "format": {"type": "tag", "begin": "<act>", "end": "</act>",
                                               "content": {"type": "json_schema", "json_schema": schema,
                                                           "max_whitespace_cnt": 1}}}  # a random model pads
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=2,
                                       extra_body={"response_format": rf})
    text = r.choices[0].message.content
    assert re.fullmatch(r"<act>(.*)</act>", text, re.S) and json.loads(text[5:-6])["act"] in range(1, 6), text
    legacy = {"type": "structural_tag", "structures": [{"begin": "<act>", "schema": schema, "end": "</act>"}],
              "triggers": ["<act>"]}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=1.0, seed=2,
                                       extra_body={"response_format": legacy})
    assert r.choices[0].finish_reason in ("stop", "length")


def test_stream_and_non_stream_same_text(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=11,
              extra_body={"guided_json": {"type": "object", "properties": {"w": {"type": "string", "maxLength": 9}},
                                          "required": ["w"], "additionalProperties": False}})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full


def test_one_process_compiles_and_caches(live):
    """Issue 29: grammars are compiled and cached in the engine-core process only: the server's
    up-front check and the request's own matcher share one compile there, and the front end
    holds no compiler (no second cache)."""
    from pagedllm.engine.core_compiles import CoreCompiles

    engine = live.engine.engine
    assert isinstance(engine.input_processor.structured, CoreCompiles)
    before = engine.client._call("structured_stats")
    body = {"model": "tiny", "prompt": "x", "max_tokens": 30, "guided_regex": "[a-e]{2}q(rs|tu)[0-9]{3}"}
    texts = [post(live, "/v1/completions", body) for _ in range(2)]
    assert all(r.status_code == 200 and re.fullmatch(r"[a-e]{2}q(rs|tu)[0-9]{3}", r.json()["choices"][0]["text"])
               for r in texts), [r.text for r in texts]
    after = engine.client._call("structured_stats")
    assert after["compiles"] - before["compiles"] == 1 and after["cached"] >= 1 and after["inflight"] == 0, after
    assert 0 < after["cache_bytes"] <= live.engine.config.structured_cache_bytes


@pytest.mark.parametrize("body, field", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"whitespace_pattern": "x"}}, "structured_outputs.whitespace_pattern"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<g>", "end": "</g>"}],
                          "triggers": ["<f>"]}}, "response_format"),
])
def test_bad_constraints_are_400_naming_the_field(live, body, field):
    for path, base in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
        r = post(live, path, {"model": "tiny", "max_tokens": 5, **base, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.json()
    assert live.engine.num_unfinished() == 0


# ---- tools ----------------------------------------------------------------------------------
def _check_calls(calls, allowed):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_tool_choice_required_and_named(client):
    for temp in (0.0, 1.0):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, ADD], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=90, temperature=temp, seed=5)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        _check_calls(c.message.tool_calls, {"get_weather", "add"})
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, ADD], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           temperature=temp, seed=6)
        c = r.choices[0]
        assert c.finish_reason == "stop" and len(c.message.tool_calls) == 1
        _check_calls(c.message.tool_calls, {"add"})


def test_streamed_tool_calls_reassemble(client):
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        kw = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, ADD], tool_choice=choice, max_tokens=90,
                  temperature=0.9, seed=8, parallel_tool_calls=False)
        full = client.chat.completions.create(**kw).choices[0]
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                slot["id"] = d.id or slot["id"]
                if d.function is not None:
                    slot["name"] = d.function.name or slot["name"]
                    slot["arguments"] += d.function.arguments or ""
        assert finish == full.finish_reason
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(t.function.name, t.function.arguments) for t in full.message.tool_calls]
        assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_hermes_parses_model_output(live, client, monkeypatch):
    """tool_choice auto: the hermes parser reads <tool_call> blocks out of the text. The random
    model never writes one, so the output is forced to a canned call with a guided_regex (the
    auto path itself adds no constraint)."""
    canned = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Verona", "unit": "c"}}</tool_call>'
    body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 200,
            "guided_regex": re.escape(canned).replace("\\ ", " ")}
    r = post(live, "/v1/chat/completions", body).json()
    c = r["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "Let me check."
    assert c["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                         "arguments": '{"city": "Verona", "unit": "c"}'}
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=10,
                                          temperature=0)
    assert free.choices[0].finish_reason in ("stop", "length") and not free.choices[0].message.tool_calls


def test_tool_history_goes_through_the_template(live):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Verona", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = httpx.post(live.url + "/tokenize", json={"model": "tiny", "messages": history}, timeout=60).json()
    text = live.state.serving.tokenizer.decode(r["tokens"])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Verona", "unit": "c"}}</tool_call>' in text
    assert "TOOL: sunny [call_1]" in text
    base = {"model": "tiny", "messages": history, "tools": [WEATHER], "max_tokens": 4}
    hidden = post(live, "/v1/chat/completions", {**base, "tool_choice": "none"}).json()["usage"]["prompt_tokens"]
    shown = post(live, "/v1/chat/completions", {**base, "tool_choice": {"type": "function", "function": {
        "name": "get_weather"}}}).json()["usage"]["prompt_tokens"]
    assert shown > hidden + 4  # the template saw the tools ("TOOLS: get_weather") only when they may be called


@pytest.mark.parametrize("body, field", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_tool_requests_are_400(live, body, field):
    r = post(live, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_auto_needs_the_server_flag(default_model):
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.serving import APIError, bad_request
    from pagedllm.entrypoints.openai.tool_calls import plan_tools

    req = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER])  # auto by default
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as e:
        plan_tools(req, False, None, bad_request)
    assert e.value.param == "tool_choice"
    assert plan_tools(req, True, "llama3_json", bad_request).mode == "auto"
