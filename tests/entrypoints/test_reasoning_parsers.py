"""Reasoning parsers (--reasoning-parser deepseek_r1 | qwen3): reasoning_content apart from
content, whole and streamed (the same split), on outputs in each family's format; through the
server with the official openai client."""
from __future__ import annotations

import re

import httpx
import pytest

from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream, get_reasoning_parser

CASES = [
    ("deepseek_r1", "Let me think. 2 + 2 is 4.\n</think>\n\nThe answer is 4.", ("Let me think. 2 + 2 is 4.\n", "The answer is 4.")),
    ("deepseek_r1", "<think>\nhm</think>ok", ("\nhm", "ok")),
    ("deepseek_r1", "reasoning cut short by max_tokens", ("reasoning cut short by max_tokens", None)),
    ("qwen3", "<think>\nstep 1\n</think>\n\nAnswer: 4", ("\nstep 1\n", "Answer: 4")),
    ("qwen3", "<think>\n\n</think>\n\nNo thinking (enable_thinking false).", (None, "No thinking (enable_thinking false).")),
    ("qwen3", "Plain answer.", (None, "Plain answer.")),
    ("qwen3", "<think>never closed", ("never closed", None)),
]


@pytest.mark.parametrize("name, text, expected", CASES)
def test_whole_and_streamed_split_alike(name, text, expected):
    parser = get_reasoning_parser(name)
    got = parser.extract(text)
    assert (got[0].strip() if got[0] else None, got[1]) == (expected[0].strip() if expected[0] else None, expected[1])
    for size in (1, 3, len(text)):
        st, r, c = ReasoningStream(parser), "", ""
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for k, piece in enumerate(pieces):
            a, b = st.feed(piece, k == len(pieces) - 1)
            r, c = r + a, c + b
        assert (r or None, c or None) == got


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser"):
        get_reasoning_parser("o1")


@pytest.fixture(scope="module")
def live(default_model):
    from conftest import ENGINE_KW, start_live
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import ServerArgs

    server = start_live(EngineConfig(model=default_model, served_model_name="tiny",
                                     **dict(ENGINE_KW, max_model_len=512, kv_cache_memory=32 << 20)),
                        ServerArgs(reasoning_parser="deepseek_r1"))
    yield server
    server.stop()


def test_server_reasoning_content(live):
    pytest.importorskip("xgrammar")
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120)
    canned = "Two and two.</think>\n\nIt is four."  # the model's output, forced (a random model never thinks)
    # the prompt closes a reasoning block, so the constraint (which forces the output) applies from the first token
    kw = dict(model="tiny", messages=[{"role": "user", "content": "2+2? <think>x</think>\n"}], max_tokens=80,
              temperature=0, extra_body={"guided_regex": re.escape(canned).replace("\\ ", " ")})
    m = client.chat.completions.create(**kw).choices[0].message
    assert m.content == "It is four." and m.model_extra["reasoning_content"] == "Two and two."
    thought, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            d = chunk.choices[0].delta
            thought += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
    assert (thought, content) == ("Two and two.", "It is four.")
    plain = httpx.post(live.url + "/v1/chat/completions", json={**{k: v for k, v in kw.items() if k != "extra_body"},
                                                               "max_tokens": 3}, timeout=60).json()
    assert plain["choices"][0]["message"]["content"] is None  # deepseek_r1: reasoning until </think>
    # a constraint waits for the reasoning to end: the (random) model reasons on, unconstrained, to max_tokens
    choice = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+2?"}], max_tokens=12,
                                            temperature=0, extra_body={"guided_choice": ["Verona", "Mantua", "Padua"]})
    c = choice.choices[0]
    assert c.finish_reason == "length" and choice.usage.completion_tokens == 12
    assert c.message.content is None and c.message.model_extra["reasoning_content"] not in ("Verona", "Mantua", "Padua")


def test_responses_reasoning_item(live):
    """deepseek_r1 without </think>: the whole (random) output is reasoning, a reasoning item."""
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model="tiny", input="2+2?", max_output_tokens=8, temperature=0)
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+2?"}],
                                          max_tokens=8, temperature=0).choices[0].message
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].summary == []
    assert r.output[0].content[0].text == chat.model_extra["reasoning_content"]
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 8
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == r.output[0].content[0].text
    assert "response.reasoning_text.done" in types and "response.output_text.delta" not in types
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 8


def test_reasoning_token_count_is_the_first_prefix_holding_the_end(default_model):
    from pagedllm.entrypoints.openai.responses import reasoning_token_count
    from pagedllm.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model)
    ids = tok.encode("Two and two make four.</think>\n\nIt is four.", add_special_tokens=False)
    linear = next(k for k in range(1, len(ids) + 1) if "</think>" in tok.decode(ids[:k]))
    assert reasoning_token_count(tok, ids, "Two and two make four.", "It is four.") == linear < len(ids)
    assert reasoning_token_count(tok, ids, "all of it", None) == len(ids)
    assert reasoning_token_count(tok, ids, None, "It is four.") == 0
