"""Output amplification is refused up front (issue 29): a response whose logprob entries (tokens x
alternatives x choices x prompts: prompt_logprobs x n, echo x logprobs x prompt length, logprobs x
max_tokens x n) would pass max_logprob_entries is a 400 before anything runs; a request that could
not fit even an idle server (best_of huge, 100 prompts x beam width) is a 400, never a 429."""
from __future__ import annotations

import httpx
import pytest

from conftest import wait_idle


def post(server, body, route="/v1/completions"):
    return httpx.post(server.url + route, json={"model": "tiny", **body}, timeout=60)


def ids(n: int, start: int = 5) -> list[int]:
    return [start + (i * 7) % 200 for i in range(n)]


@pytest.mark.parametrize("body, param", [
    ({"prompt": ids(200), "n": 128, "prompt_logprobs": 20, "max_tokens": 1}, "prompt_logprobs"),  # the shape
    ({"prompt": ids(200), "n": 128, "echo": True, "logprobs": 20, "max_tokens": 1}, "echo"),  # 128 x 200 x 21
    ({"prompt": [ids(100, s) for s in range(40)], "n": 16, "echo": True, "logprobs": 10, "max_tokens": 1},
     "echo"),  # 40 prompts x 16 x 100 x 11
    ({"prompt": ids(10), "n": 128, "logprobs": 20, "max_tokens": 200}, "logprobs"),
])
def test_amplified_logprob_responses_are_400(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "response_too_large" and "max_logprob_entries" in err["message"], err
    assert err["param"] == param, err
    wait_idle(server.engine)


def test_chat_logprob_volume_is_bounded(server):
    r = post(server, {"messages": [{"role": "user", "content": "hi"}], "n": 128, "logprobs": True,
                      "top_logprobs": 20, "max_tokens": 200}, "/v1/chat/completions")
    assert r.status_code == 400 and "max_logprob_entries" in r.text, r.text[:300]


def test_under_the_bound_still_answers(server):
    r = post(server, {"prompt": ids(20), "n": 2, "echo": True, "logprobs": 3, "prompt_logprobs": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"]) == 2


@pytest.mark.parametrize("body", [
    {"prompt": ids(5), "n": 1, "best_of": 1_000_000_000, "max_tokens": 2},
    {"prompt": [ids(5, s) for s in range(100)], "n": 16, "use_beam_search": True, "max_tokens": 2},
    {"prompt": [ids(5, s) for s in range(100)], "n": 13, "max_tokens": 2},
])
def test_requests_that_can_never_fit_are_400_not_429(server, body):
    r = post(server, body)
    assert r.status_code == 400, r.text[:300]
    assert "Retry-After" not in r.headers
    wait_idle(server.engine)
