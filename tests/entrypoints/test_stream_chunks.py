"""A stream's usual chunk is written from a template, not from pydantic models
(protocol.CompletionChunks, protocol.ChatChunks): it must be byte for byte what the models give,
for any text the detokenizer can produce, and every chunk of a stream shares one ``created``."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.protocol import (
    ChatChunks, ChatCompletionStreamResponse, ChatStreamChoice, CompletionChoice, CompletionChunks,
    CompletionStreamResponse, DeltaMessage,
)

SPECIAL = "".join(chr(c) for c in range(0x80)) + "é中文\u2028\u2029\U0001f600\ufffd\"\\/"


def via_models(chunks, index, text, finish_reason, stop_reason) -> str:
    if isinstance(chunks, ChatChunks):
        choice = ChatStreamChoice(index=index, delta=DeltaMessage(content=text), finish_reason=finish_reason,
                                  stop_reason=stop_reason)
        response = ChatCompletionStreamResponse(id=chunks.rid, created=chunks.created, model=chunks.model,
                                                choices=[choice])
    else:
        choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason)
        response = CompletionStreamResponse(id=chunks.rid, created=chunks.created, model=chunks.model,
                                            choices=[choice])
    return f"data: {response.model_dump_json()}\n\n"


def template(chunks, index, text, finish_reason, stop_reason) -> str:
    make = chunks.content if isinstance(chunks, ChatChunks) else chunks.text
    return make(index, text, finish_reason, stop_reason)


KINDS = [CompletionChunks, ChatChunks]


@pytest.mark.parametrize("finish_reason, stop_reason", [(None, None), ("stop", None), ("length", None),
                                                         ("stop", 2), ("stop", "\n\n"), ("abort", None)])
@pytest.mark.parametrize("kind", KINDS)
def test_template_chunk_equals_the_models(kind, finish_reason, stop_reason):
    chunks = kind('cmpl-"x"\\1', "org/model é")
    for text in ("", " the", SPECIAL, "\x00\x1f\x7f", "a\nb\tc\rd\x08e\x0cf"):
        got = template(chunks, 3, text, finish_reason, stop_reason)
        assert got == via_models(chunks, 3, text, finish_reason, stop_reason)
        choice = json.loads(got[len("data: "):])["choices"][0]
        assert (choice["delta"]["content"] if kind is ChatChunks else choice["text"]) == text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",))), index=st.integers(0, 10_000),
       kind=st.sampled_from(KINDS))
def test_template_chunk_equals_the_models_for_any_text(text, index, kind):
    chunks = kind("cmpl-1", "tiny")
    assert template(chunks, index, text, None, None) == via_models(chunks, index, text, None, None)


@pytest.mark.parametrize("kind", KINDS)
def test_model_chunks_share_the_streams_created(kind):
    chunks = kind("cmpl-1", "tiny")
    other = json.loads(chunks.model_chunk([])[len("data: "):])
    assert other["created"] == chunks.created == json.loads(template(chunks, 0, "x", None, None)[6:])["created"]
