"""/v1/responses with the official openai client (``client.responses``), on the default model (a
real byte-level BPE tokenizer): text and message-item input, instructions, max_output_tokens,
streaming events, text.format json_schema, function tools and their outputs round trip,
previous_response_id, store false, retrieve / cancel / delete, background; /v1/models/{id}."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

from conftest import ENGINE_KW, start_live, wait_idle  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}{% endif %}"
    "{% if m.get('tool_call_id') %} [{{ m['tool_call_id'] }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)
ADD = {"type": "function", "name": "add", "description": "adds", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def live(default_model, tmp_path_factory):
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import ServerArgs

    tpl = tmp_path_factory.mktemp("tpl") / "t.jinja"
    tpl.write_text(TEMPLATE)
    args = ServerArgs(chat_template=str(tpl), enable_auto_tool_choice=True, tool_call_parser="hermes")
    kw = dict(ENGINE_KW, max_model_len=1024, kv_cache_memory=64 << 20)
    server = start_live(EngineConfig(model=default_model, served_model_name="tiny", **kw), args)
    yield server
    server.stop()


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def prompt_tokens(live, messages) -> int:
    r = httpx.post(live.url + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=60)
    return r.json()["count"]


def test_text_input_matches_chat(live, client):
    r = client.responses.create(model="tiny", input="ROMEO: what light", instructions="Be brief.",
                                max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model="tiny", max_completion_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "ROMEO: what light"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 8
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"


def test_message_items_and_sampling(live, client):
    items = [{"role": "developer", "content": "Answer."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "KING: "},
                                                              {"type": "input_text", "text": "speak"}]}]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0.8, top_p=0.9)
    assert r.temperature == 0.8 and r.top_p == 0.9
    assert r.usage.input_tokens == prompt_tokens(live, [{"role": "system", "content": "Answer."},
                                                        {"role": "user", "content": "KING: speak"}])


def test_stream_events(client):
    kw = dict(model="tiny", input="To be, or not", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text
    assert events[-4].text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.status == whole.status and events[0].response.status == "in_progress"
    assert client.responses.retrieve(final.id).output_text == text  # streamed responses are stored too


def test_output_text_logprobs_whole_and_streamed(client):
    kw = dict(model="tiny", input="To be, or not", max_output_tokens=6, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=2, reasoning={"effort": "low"})
    whole = client.responses.create(**kw)
    lps = whole.output[0].content[0].logprobs
    chat = client.chat.completions.create(model="tiny", max_completion_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2, messages=[{"role": "user", "content": "To be, or not"}])
    ref = chat.choices[0].logprobs.content
    assert len(lps) == whole.usage.output_tokens == len(ref)
    assert [t.token for t in lps] == [t.token for t in ref] and all(len(t.top_logprobs) == 2 for t in lps)
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(lps, ref))  # a prefix-cache hit may round apart
    assert whole.top_logprobs == 2 and whole.reasoning.effort == "low"
    events = list(client.responses.create(stream=True, **kw))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [t.token for t in streamed] == [t.token for t in lps]
    assert [t.token for t in next(e for e in events if e.type == "response.output_text.done").logprobs] == \
        [t.token for t in lps]
    plain = client.responses.create(model="tiny", input="To be", max_output_tokens=2, top_logprobs=2)
    assert plain.output[0].content[0].logprobs == []  # top_logprobs alone: no logprobs (as OpenAI)


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 10},
                                               "answer": {"type": "boolean"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Is it day?", max_output_tokens=200, temperature=0,
                                text={"format": {"type": "json_schema", "name": "verdict", "schema": schema,
                                                 "strict": True}})
    value = json.loads(r.output_text)
    jsonschema.validate(value, schema)
    assert list(value) == ["reasoning", "answer"] and r.text.format.type == "json_schema"


def test_function_call_and_output_round_trip(live, client):
    r = client.responses.create(model="tiny", input="add 2 and 3", tools=[ADD], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "add" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    follow = client.responses.create(model="tiny", previous_response_id=r.id, tools=[ADD], tool_choice="none",
                                     max_output_tokens=4, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    expected = [{"role": "user", "content": "add 2 and 3"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "5"}]
    assert follow.usage.input_tokens == prompt_tokens(live, expected)
    assert follow.previous_response_id == r.id
    # the same history sent as items (no previous_response_id) is the same prompt
    items = [{"role": "user", "content": "add 2 and 3"},
             {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    again = client.responses.create(model="tiny", input=items, max_output_tokens=4, temperature=0)
    assert again.usage.input_tokens == follow.usage.input_tokens and again.output_text == follow.output_text


def test_named_function_streams_arguments(client):
    kw = dict(model="tiny", input="add", tools=[ADD], tool_choice={"type": "function", "name": "add"},
              max_output_tokens=60, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == whole.output[0].arguments == done[0].arguments and done[0].name == "add"
    assert events[-1].response.output[0].type == "function_call"


def test_previous_response_continues_the_conversation(live, client):
    first = client.responses.create(model="tiny", input="First Citizen:", instructions="Speak.",
                                    max_output_tokens=5, temperature=0)
    second = client.responses.create(model="tiny", input="Again", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    history = [{"role": "user", "content": "First Citizen:"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "Again"}]  # instructions are not carried over
    assert second.usage.input_tokens == prompt_tokens(live, history)
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"]


def test_a_client_chosen_request_id_never_replaces_a_stored_response(live, client):
    victim = client.responses.create(model="tiny", input="Second Citizen:", max_output_tokens=3, temperature=0)
    for rid in (victim.id, "my-own-id"):
        other = client.responses.create(model="tiny", input="someone else", max_output_tokens=2,
                                        extra_body={"request_id": rid})
        assert other.id != victim.id and other.id.startswith("resp_")
    items = client.responses.input_items.list(victim.id)
    assert [i.content for i in items.data] == ["Second Citizen:"]
    assert client.responses.retrieve(victim.id).output_text == victim.output_text
    follow = client.responses.create(model="tiny", input="Again", previous_response_id=victim.id,
                                     max_output_tokens=2, temperature=0)
    history = [{"role": "user", "content": "Second Citizen:"}, {"role": "assistant", "content": victim.output_text},
               {"role": "user", "content": "Again"}]
    assert follow.usage.input_tokens == prompt_tokens(live, history)


def test_store_false_retrieve_delete_cancel(live, client):
    r = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="y", previous_response_id=r.id, max_output_tokens=2)
    kept = client.responses.create(model="tiny", input="x", max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(kept.id)
    assert got.id == kept.id and got.output_text == kept.output_text and got.status == kept.status
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(kept.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)


def test_background_cancel_frees_the_engine(live, client):
    long_text = {"format": {"type": "json_schema", "name": "t", "schema": {"type": "string", "minLength": 2000}}}
    r = client.responses.create(model="tiny", input="Once upon", max_output_tokens=900, background=True,
                                temperature=1.0, text=long_text)  # cannot end before hundreds of tokens
    assert r.status in ("queued", "in_progress") and r.background
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    wait_idle(live.engine)
    done = client.responses.create(model="tiny", input="Once", max_output_tokens=3, background=True, temperature=0)
    deadline = time.monotonic() + 60
    while client.responses.retrieve(done.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    final = client.responses.retrieve(done.id)
    assert final.status in ("completed", "incomplete") and final.usage.output_tokens <= 3


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "store": False, "background": True}, "background"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
])
def test_bad_requests_name_the_field(live, body, param):
    r = httpx.post(live.url + "/v1/responses", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_model_card_by_id(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_store_is_bounded():
    from pagedllm.entrypoints.openai.responses import ResponseStore, StoredResponse
    from pagedllm.entrypoints.openai.responses_protocol import ResponseObject

    store = ResponseStore(max_entries=3, max_chars=10_000)
    for i in range(5):
        store.put(StoredResponse(ResponseObject(id=f"r{i}", model="m"), [{"role": "user", "content": "x"}], []))
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.put(StoredResponse(ResponseObject(id="big", model="m"), [{"role": "user", "content": "y" * 9_990}], []))
    assert store.get("big") is not None and len(store) == 1  # over max_chars: older ones went


def test_auto_tool_calls_stream_as_function_call_items():
    """tool_choice auto (hermes): text before the call is a message item, the call a function_call
    item, with the Responses events in order (a fake engine stream with the model's output)."""
    from pagedllm.entrypoints.openai import tool_calls as tc
    from pagedllm.entrypoints.openai.responses import ServingResponses, StoredResponse
    from pagedllm.entrypoints.openai.responses_protocol import ResponseObject
    from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
    from pagedllm.outputs import CompletionOutput, RequestOutput

    text = 'Checking. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]

    class Streams:
        async def __aiter__(self):
            for k, p in enumerate(pieces):
                last = k == len(pieces) - 1
                yield 0, RequestOutput("r", None, [1], None, [CompletionOutput(0, p, [k], None, None,
                                                                               "stop" if last else None)], last)

        def close(self):
            pass

    async def run():
        serving = ServingResponses(SimpleNamespace(reasoning_parser=None, tokenizer=None))
        entry = StoredResponse(ResponseObject(id="resp_1", model="m"), [], [])
        plan = tc.ToolPlan("auto", [], None, get_tool_parser("hermes"))
        return [c async for c in serving.stream(entry, Streams(), plan, 3)], serving

    chunks, serving = asyncio.run(run())
    events = [json.loads(c.split("data: ", 1)[1]) for c in chunks]
    types = [t for k, t in enumerate(e["type"] for e in events) if k == 0 or events[k - 1]["type"] != t]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Checking."
    assert final["output"][1]["name"] == "add" and json.loads(final["output"][1]["arguments"]) == {"a": 1, "b": 2}
    assert serving.store.get("resp_1").conversation[-1]["tool_calls"][0]["function"]["name"] == "add"
