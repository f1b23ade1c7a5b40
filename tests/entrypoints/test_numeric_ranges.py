"""Numeric request fields at the HTTP boundary (issue 29): NaN and +-Infinity (which Python's JSON
reader accepts as literals) are refused with 400 naming the field; beam requests with the extreme
but finite length penalties that once killed the engine answer 200, and the engine stays alive."""
from __future__ import annotations

import httpx
import pytest

PROMPT = "w11 w12 w13 w14 w15"


def post(server, body: dict | str, route: str = "/v1/completions") -> httpx.Response:
    if isinstance(body, str):
        return httpx.post(server.url + route, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(server.url + route, json=body, timeout=60)


@pytest.mark.parametrize("lp", [1100, -2000, 1e308, -1e308, 5e-324])
def test_extreme_finite_length_penalties_answer_200(server, lp):
    r = post(server, {"model": "tiny", "prompt": PROMPT, "n": 2, "max_tokens": 4, "use_beam_search": True,
                      "length_penalty": lp})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    assert server.engine.is_running


@pytest.mark.parametrize("field", ["length_penalty", "temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_400_naming_the_field(server, field, literal):
    extra = ', "use_beam_search": true, "n": 2' if field == "length_penalty" else ""
    r = post(server, f'{{"model": "tiny", "prompt": "{PROMPT}", "max_tokens": 2, "{field}": {literal}{extra}}}')
    assert r.status_code == 400, r.text
    assert field in (r.json()["error"].get("param") or "") + r.json()["error"]["message"], r.text


@pytest.mark.parametrize("literal", ["NaN", "Infinity"])
def test_non_finite_logit_bias_and_chat_fields_are_400(server, literal):
    r = post(server, f'{{"model": "tiny", "prompt": "{PROMPT}", "max_tokens": 2, "logit_bias": {{"5": {literal}}}}}')
    assert r.status_code == 400 and "logit_bias" in r.text, r.text
    r = post(server, f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2, '
                     f'"temperature": {literal}}}', route="/v1/chat/completions")
    assert r.status_code == 400 and "temperature" in r.text, r.text
    assert server.engine.is_running
