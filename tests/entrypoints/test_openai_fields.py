"""Every request field of the installed openai client is honoured, refused (400 naming it) or on
the accepted-and-ignored list (billing/storage; docs/usage.md). A new openai version that adds a
field fails here until someone decides which it is."""
from __future__ import annotations

import pytest

openai_types = pytest.importorskip("openai.types")

from openai.types import completion_create_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_create_params  # noqa: E402

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
CHAT_HONOURED = {"messages", "model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
                 "top_logprobs", "max_tokens", "max_completion_tokens", "n", "seed", "stop", "stream_options",
                 "temperature", "top_p", "response_format", "tools", "tool_choice", "parallel_tool_calls"}
CHAT_REFUSED = {  # field -> a non-default value a client could send
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}], "modalities": ["text", "audio"], "moderation": {"x": 1},
    "prediction": {"type": "content", "content": "x"}, "prompt_cache_options": {"x": 1},
    "prompt_cache_retention": "24h", "reasoning_effort": "high", "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
}
COMPLETION_HONOURED = {"prompt", "model", "echo", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
                       "max_tokens", "n", "seed", "stop", "stream_options", "temperature", "top_p",
                       "best_of"}  # best_of: sampled best-of-n (engine/best_of.py)
COMPLETION_REFUSED = {"suffix": "the end"}
IGNORED_VALUES = {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
                  "prompt_cache_key": "k", "safety_identifier": "s"}


def test_every_chat_field_is_decided():
    fields = set(chat_create_params.CompletionCreateParamsBase.__annotations__)
    decided = CHAT_HONOURED | IGNORED | set(CHAT_REFUSED)
    assert fields - decided == set(), "new openai chat fields: honour, refuse or ignore them"
    declared = set(ChatCompletionRequest.model_fields)
    assert CHAT_HONOURED | IGNORED <= declared
    assert not set(CHAT_REFUSED) & declared


def test_every_completion_field_is_decided():
    fields = set(completion_create_params.CompletionCreateParamsBase.__annotations__)
    decided = COMPLETION_HONOURED | (IGNORED & fields) | set(COMPLETION_REFUSED)
    assert fields - decided == set(), "new openai completion fields: honour, refuse or ignore them"
    assert COMPLETION_HONOURED | (IGNORED & fields) <= set(CompletionRequest.model_fields)


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("field", sorted(CHAT_REFUSED))
def test_refused_chat_fields_are_400_naming_them(http, field):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                                                "max_tokens": 1, field: CHAT_REFUSED[field]})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_refused_completion_fields_are_400_naming_them(http):
    for field, value in COMPLETION_REFUSED.items():
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 1, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_ignored_fields_are_accepted(http):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 1, **IGNORED_VALUES}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    comp = {"model": "tiny", "prompt": "w1", "max_tokens": 1, **IGNORED_VALUES}
    assert http.post("/v1/completions", json=comp).status_code == 200
