"""Each refusal is written once on the way from the HTTP body to the engine: the same bad field
gets the same status and names the same field through completions, chat and responses."""
from __future__ import annotations

import httpx
import pytest

from conftest import ENGINE_KW, start_live

BAD = [("temperature", -1), ("temperature", "hot"), ("top_p", 2), ("top_p", 0), ("n", 0), ("n", 10**6),
       ("max_tokens", -1), ("max_tokens", 10**6), ("seed", "x"), ("seed", 2**70), ("presence_penalty", 3),
       ("frequency_penalty", -3), ("top_k", -2), ("min_p", 2), ("repetition_penalty", 0), ("logit_bias", {"x": 1}),
       ("stop", [1]), ("best_of", 0), ("min_tokens", -1), ("truncate_prompt_tokens", 0), ("stop_token_ids", [-1]),
       ("bad_words", [1]), ("allowed_token_ids", [10**9]), ("top_logprobs", 100), ("user", 5), ("unknown_field", 1)]
ROUTES = [("/v1/completions", {"prompt": "ROMEO:"}, "max_tokens"),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
          ("/v1/responses", {"input": "hi"}, "max_output_tokens")]


@pytest.fixture(scope="module")
def live(default_model):
    from pagedllm.config import EngineConfig

    server = start_live(EngineConfig(model=default_model, served_model_name="tiny", **ENGINE_KW))
    yield server
    server.stop()


@pytest.mark.parametrize("field, value", BAD, ids=[f"{f}={str(v)[:12]}" for f, v in BAD])
def test_a_bad_field_is_refused_alike_by_every_api(live, field, value):
    seen = []
    for route, base, cap in ROUTES:
        name = cap if field == "max_tokens" else field
        r = httpx.post(live.url + route, json={"model": "tiny", **base, cap: 2, name: value}, timeout=60)
        error = r.json().get("error") or {}
        seen.append((r.status_code, error.get("param")))
        assert r.status_code == 400 and error.get("param") == name, (route, r.text)
    assert len({s for s, _ in seen}) == 1
