"""Beam search and best_of through the server, driven by the official openai client:
use_beam_search (vLLM's extra, n = beam width) equals the offline LLM.beam_search, on
completions and chat; best_of > n returns what offline best_of returns; the refusals are 400s
naming the field (streamed beam search or best_of > n, sampling fields with beam search)."""
from __future__ import annotations

import httpx
import openai
import pytest

from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.sampling_params import SamplingParams

PROMPT = "w11 w12 w13 w14 w15"


def test_completion_beam_search_equals_offline(client, offline):
    r = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=8, temperature=0,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True})
    ref = offline.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5,
                                                       ignore_eos=True))[0]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.text for s in ref.sequences]
    assert len({c.text for c in r.choices}) == 3
    assert r.usage.completion_tokens == sum(len(s.tokens) - 5 for s in ref.sequences)


def test_chat_beam_search(client, offline):
    msgs = [{"role": "user", "content": "w7 w8 w9"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, n=2, max_tokens=6,
                                       extra_body={"use_beam_search": True, "early_stopping": "never"})
    ids = offline.get_tokenizer().apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    ref = offline.beam_search({"prompt_token_ids": list(ids)},
                              BeamSearchParams(beam_width=2, max_tokens=6, early_stopping="never"))[0]
    assert [c.message.content for c in r.choices] == [s.text for s in ref.sequences]


def test_best_of_equals_offline(client, offline):
    r = client.completions.create(model="tiny", prompt=PROMPT, n=2, best_of=5, max_tokens=8, temperature=1.0, seed=3)
    ref = offline.generate([PROMPT], SamplingParams(n=2, best_of=5, max_tokens=8, temperature=1.0, seed=3),
                           use_tqdm=False)[0]
    assert [c.text for c in r.choices] == [c.text for c in ref.outputs]


@pytest.mark.parametrize("body, param", [
    ({"best_of": 3, "n": 1, "stream": True}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"use_beam_search": True, "n": 2, "stream": True}, "stream"),
    ({"use_beam_search": True, "n": 2, "temperature": 0.8}, "temperature"),
    ({"use_beam_search": True, "n": 2, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "n": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ({"use_beam_search": True, "n": 2, "best_of": 4}, "best_of"),
    ({"use_beam_search": True, "n": 2, "response_format": {"type": "json_object"}}, "use_beam_search"),
])
def test_refused_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    if "response_format" in body:  # refused by beam search, or by a server without structured outputs
        assert r.json()["error"]["param"] in (param, "response_format"), r.text
    else:
        assert r.json()["error"]["param"] == param, r.text


def test_stream_refusal_through_the_client(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPT, n=1, best_of=2, max_tokens=4, stream=True)
