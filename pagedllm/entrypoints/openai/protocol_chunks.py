"""The SSE chunks of a completions or chat stream. The usual chunk (one choice's new text; no
logprobs, token ids or usage) is a template around its JSON-escaped text, byte for byte what the
response model's ``model_dump_json()`` gives (tests/entrypoints/test_stream_chunks.py pins it),
without building pydantic models per token; other chunks are built from the models
(``model_chunk``). Every chunk of the stream has the same ``created``, as OpenAI's do."""
from __future__ import annotations

import json
from typing import Optional

from pagedllm.entrypoints.openai.protocol_base import UsageInfo, unix_now
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionStreamResponse
from pagedllm.entrypoints.openai.protocol_completions import CompletionStreamResponse

_json_string = json.encoder.encode_basestring  # (C) escapes as pydantic does, non-ASCII kept


def _json(value) -> str:
    """A str, int or None as JSON, quickly (the stream templates' values)."""
    if value is None:
        return "null"
    return _json_string(value) if isinstance(value, str) else json.dumps(value)


class StreamChunks:
    """The SSE events of one stream (a subclass names the ``OBJECT`` and its ``RESPONSE`` model)."""

    OBJECT: str
    RESPONSE: type

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model, self.created = rid, model, unix_now()
        self._head = (f'data: {{"id":{_json(rid)},"object":"{self.OBJECT}","created":{self.created},'
                      f'"model":{_json(model)},"choices":[{{"index":')

    @staticmethod
    def _tail(finish_reason: Optional[str], stop_reason) -> str:
        return f'"logprobs":null,"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}'

    def model_chunk(self, choices: list, usage: Optional[UsageInfo] = None, **extra) -> str:
        response = self.RESPONSE(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage,
                                 **extra)
        return f"data: {response.model_dump_json()}\n\n"


class CompletionChunks(StreamChunks):
    OBJECT, RESPONSE = "text_completion", CompletionStreamResponse

    def text(self, index: int, text: str, finish_reason: Optional[str], stop_reason) -> str:
        return (f'{self._head}{index},"text":{_json(text)},{self._tail(finish_reason, stop_reason)},'
                f'"prompt_logprobs":null}}],"usage":null}}\n\n')


class ChatChunks(StreamChunks):
    OBJECT, RESPONSE = "chat.completion.chunk", ChatCompletionStreamResponse

    def content(self, index: int, text: str, finish_reason: Optional[str], stop_reason) -> str:
        return (f'{self._head}{index},"delta":{{"content":{_json(text)}}},{self._tail(finish_reason, stop_reason)}}}],'
                f'"usage":null}}\n\n')
