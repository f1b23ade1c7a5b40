"""vLLM's request extensions through the server (openai client, extra_body) and offline:
continuous usage stats, prompt scoring (max_tokens 0 + echo + logprobs), truncate_prompt_tokens,
bad_words, allowed_token_ids, logits processors, return_token_ids, request_id, cache_salt,
continue_final_message + echo, add_special_tokens, fields vLLM ignores, detokenize=False."""
from __future__ import annotations

import httpx
import pytest

from pagedllm import SamplingParams

from conftest import wait_idle  # noqa: E402

PROMPT = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"


def post(server, path, body):
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)


def test_continuous_usage_stats(client):
    for stream in (client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                             stream_options={"include_usage": True, "continuous_usage_stats": True}),
                   client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                  max_tokens=6, temperature=0, stream=True,
                                                  stream_options={"include_usage": True,
                                                                  "continuous_usage_stats": True})):
        chunks = list(stream)
        counted = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
        content = [c for c in chunks if c.choices and (getattr(c.choices[0], "text", None)
                                                       or getattr(getattr(c.choices[0], "delta", None), "content", None))]
        assert content and all(c.usage is not None for c in content)
        assert counted == sorted(counted) and counted[-1] == chunks[-1].usage.completion_tokens
        assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in content)
        assert all(c.usage is not None for c in chunks)  # every chunk, the chat's first (role) one too (vLLM's)
        assert chunks[0].usage.completion_tokens == 0 or not hasattr(chunks[0].choices[0], "delta")


def test_prompt_scoring_max_tokens_0(client, offline):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert c.text == PROMPT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lps = c.logprobs.token_logprobs
    assert len(lps) == len(ref.prompt_token_ids) and lps[0] is None
    expected = [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ref.prompt_token_ids) if i > 0]
    assert lps[1:] == pytest.approx(expected, abs=1e-4)


def test_max_tokens_0_needs_echo(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_truncate_prompt_tokens(client, offline, server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 4})
    ref = offline.generate([ids[-4:]], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert r.usage.prompt_tokens == 4 and r.choices[0].text == ref.outputs[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    long = client.completions.create(model="tiny", prompt="w1 " * 400, max_tokens=2,
                                     extra_body={"truncate_prompt_tokens": 10})  # longer than max_model_len
    assert long.usage.prompt_tokens == 10


def test_allowed_token_ids_and_bad_words(client):
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0]
    allowed = sorted(set(base.token_ids[1:3])) or [5]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True}).choices[0]
    assert r.token_ids and set(r.token_ids) <= set(allowed)
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0).choices[0].text
    banned = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"bad_words": [first.strip() or first],
                                                   "return_token_ids": True}).choices[0]
    assert banned.token_ids[0] != base.token_ids[0]


def test_allowed_token_ids_out_of_vocab_400(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
    r = post(server, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_return_token_ids_and_request_id(server, client):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "return_token_ids": True,
                                         "request_id": "abc-1"}).json()
    assert r["id"] == "cmpl-abc-1" and r["choices"][0]["prompt_token_ids"] == ids
    assert len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"]
    plain = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 3,
                                                 "return_token_ids": True, "request_id": "xyz"}).json()
    assert chat["id"] == "chatcmpl-xyz" and chat["prompt_token_ids"] and chat["choices"][0]["token_ids"]
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}],
                                                 max_tokens=3, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == chat["prompt_token_ids"]


def test_cache_salt_isolates_the_prefix_cache(server):
    prompt = " ".join(f"w{i}" for i in range(1, 60))
    first = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "t1"}).json()
    again = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "t1"}).json()
    other = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "t2"}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_idle(server.engine)


def test_continue_final_message_and_echo(server, client):
    msgs = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w7 w8"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "echo": True})
    assert r.choices[0].message.content.startswith("w7 w8")
    rendered = "user: w1 w2 assistant: w7 w8"  # the test template, cut after the final content
    ids = httpx.post(server.url + "/tokenize", json={"prompt": rendered, "add_special_tokens": False},
                     timeout=30).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=4, temperature=0, stream=True,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True}) if c.choices)
    assert streamed == r.choices[0].message.content
    bad = post(server, "/v1/chat/completions", {"messages": msgs, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_add_special_tokens_and_ignored_fields(server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False},
                     timeout=30).json()["tokens"]
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "add_special_tokens": False}).json()
    assert r["usage"]["prompt_tokens"] == len(ids)
    body = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2, "parallel_tool_calls": False,
            "kv_transfer_params": {"do_remote_prefill": False}, "vllm_xargs": {"x": 1}, "mm_processor_kwargs": {},
            "spaces_between_special_tokens": False, "priority": 0, "add_special_tokens": True,
            "documents": [{"title": "t", "text": "d"}]}
    assert post(server, "/v1/chat/completions", body).status_code == 200


def test_priority_needs_the_priority_policy(server):
    """As vLLM: a non-zero priority under the fcfs policy is refused, naming the field."""
    if getattr(server.engine.config, "scheduling_policy", "fcfs") == "priority":
        pytest.skip("this server schedules by priority")
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "priority": -3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_offline_request_masks(offline):
    base = offline.generate(["w1 w2 w3"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    allowed = sorted(set(base.token_ids[2:5]))
    out = offline.generate(["w1 w2 w3"], SamplingParams(max_tokens=8, temperature=1.0, seed=4,
                                                         allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    word = offline.get_tokenizer().decode([base.token_ids[0]])
    out = offline.generate(["w1 w2 w3"], SamplingParams(max_tokens=8, temperature=0, bad_words=[word]),
                           use_tqdm=False)[0].outputs[0]
    assert base.token_ids[0] not in out.token_ids[:1]

    def only_seven(output_ids, logits):
        logits.fill_(-1e9)
        logits[7] = 0.0
        return logits

    out = offline.generate(["w1"], SamplingParams(max_tokens=3, temperature=0, logits_processors=[only_seven]),
                           use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [7, 7, 7]
    out = offline.generate(["w1 " * 400], SamplingParams(max_tokens=2, temperature=0, truncate_prompt_tokens=6,
                                                          detokenize=False), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 6 and out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
