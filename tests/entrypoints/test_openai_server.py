"""The OpenAI-compatible server, driven by the official ``openai`` client against a live uvicorn."""
from __future__ import annotations

import asyncio

import time

import httpx
import pytest
from conftest import LiveServer, make_engine, wait_idle

from pagedllm.sampling_params import SamplingParams

PROMPT = "w11 w12 w13 w14 w15"


def greedy(offline, prompt, n_tokens, **kw):
    out = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=n_tokens, **kw), use_tqdm=False)[0]
    return out.outputs[0]


# ---- basics ----------------------------------------------------------------------------------
def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_matches_offline_greedy(server, client, offline):
    ref = greedy(offline, PROMPT, 12)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny" and r.created > 0
    c = r.choices[0]
    assert c.text == ref.text and c.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_concatenates_to_full_text(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.9, seed=1234)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_seed_reproducible(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (8, 9, 10)}
    assert a == b
    assert others - {a}, "different seeds should give different samples"


def test_n2_and_prompt_forms(client, offline):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.text.split()) for c in r.choices)  # word-level tokenizer
    ids = offline.get_tokenizer().encode(PROMPT)
    by_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert by_ids == by_text
    multi = client.completions.create(model="tiny", prompt=[ids, [6, 7]], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in sorted(multi.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert multi.choices[0].text == by_text == multi.choices[1].text
    assert multi.usage.prompt_tokens == len(ids) + 2


def test_n2_streaming_each_index_separately(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, n=2, temperature=1.0, seed=11)
    full = client.completions.create(**kw)
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **kw):
        assert len(chunk.choices) == 1
        c = chunk.choices[0]
        texts[c.index] += c.text
        if c.finish_reason:
            finishes[c.index].append(c.finish_reason)
    for c in full.choices:
        assert texts[c.index] == c.text
        assert finishes[c.index] == [c.finish_reason]


def test_stop_strings(client, offline):
    ref = greedy(offline, PROMPT, 12, ignore_eos=True)
    words = ref.text.split()
    stop = words[3]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "stop" and stop not in c.text
    assert ref.text.startswith(c.text) and c.text.strip() == " ".join(words[: words.index(stop)])
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert r.choices[0].text.endswith(stop)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == c.text


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4 and top[tok] == pytest.approx(val)
        assert max(top.values()) == pytest.approx(val)  # greedy: the sampled token is the most likely
    assert lp.text_offset == sorted(lp.text_offset)
    e = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, echo=True)
    ec = e.choices[0]
    assert ec.text == PROMPT + r.choices[0].text
    assert ec.logprobs.tokens[:5] == PROMPT.split() and ec.logprobs.token_logprobs[0] is None
    assert all(v is not None for v in ec.logprobs.token_logprobs[1:])
    assert ec.logprobs.tokens[5:] == lp.tokens
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ec.text
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == 10


def test_vllm_extras_and_penalties_accepted(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.7, top_p=0.9,
                                  presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"7": 5.0}, user="u1",
                                  seed=5, extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                                                      "min_tokens": 8, "ignore_eos": True,
                                                      "skip_special_tokens": False})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    forced = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={"7": 100.0})
    assert forced.choices[0].text.split() == ["w4"] * 4  # id 7 is the word w4


# ---- chat ------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w5 w6 w7"}]


def test_chat_matches_offline(client, offline):
    ref = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    m = r.choices[0].message
    assert m.role == "assistant" and m.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    r2 = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=3, temperature=0)
    assert r2.usage.completion_tokens <= 3


def test_chat_stream_role_first_and_usage(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.8, seed=42)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_n2_stream_and_logprobs(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=6, n=2, temperature=1.0, seed=9, logprobs=True,
              top_logprobs=2)
    full = client.chat.completions.create(**kw)
    texts, roles, lps = {0: "", 1: ""}, set(), {0: [], 1: []}
    for chunk in client.chat.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        if c.delta.role:
            roles.add(c.index)
        texts[c.index] += c.delta.content or ""
        if c.logprobs and c.logprobs.content:
            lps[c.index] += c.logprobs.content
    assert roles == {0, 1}
    for c in full.choices:
        assert texts[c.index] == c.message.content
        content = c.logprobs.content
        assert [t.token for t in content] == [t.token for t in lps[c.index]]
        for t in content:
            assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 2
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


# ---- tokenizer endpoints, metrics --------------------------------------------------------------
def test_tokenize_detokenize(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "w1 w2 w3"}).json()
    assert r["tokens"] == [4, 5, 6] and r["count"] == 3 and r["max_model_len"] == 256
    r = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert r["count"] > 5
    assert httpx.post(server.url + "/detokenize", json={"tokens": [4, 5, 6]}).json()["prompt"] == "w1 w2 w3"
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def _metric(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_metrics(server, client):
    wait_idle(server.engine)
    before = httpx.get(server.url + "/metrics").text
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, n=2, temperature=0)
    wait_idle(server.engine)
    text = httpx.get(server.url + "/metrics").text

    def delta(prefix):
        return _metric(text, prefix) - _metric(before, prefix)

    assert delta('pagedllm:request_success_total{engine="0",finished_reason="length"') == 3  # one per sequence
    assert delta("pagedllm:prompt_tokens_total") == 10 and delta("pagedllm:generation_tokens_total") == 10
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_time_per_output_token_seconds",
              "request_queue_time_seconds"):
        assert delta(f"pagedllm:{h}_count") == 2, h
    assert delta("pagedllm:prefix_cache_queries_total") > 0 and delta("pagedllm:engine_steps_total") >= 4
    assert _metric(text, "pagedllm:num_requests_running") == 0 and _metric(text, "pagedllm:kv_cache_usage_perc") == 0
    assert "pagedllm:num_preemptions_total" in text and "pagedllm:num_requests_waiting" in text


# ---- concurrency and disconnects ---------------------------------------------------------------
def test_64_concurrent_streams(server, offline):
    import openai

    prompts = [" ".join(f"w{(7 * i + j) % 500 + 3}" for j in range(3 + i % 13)) for i in range(64)]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    wait_idle(server.engine)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(p):
            text, finish = "", None
            async for chunk in await client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                                               stream=True):
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return text, finish

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(run())
    for (text, finish), ref in zip(results, refs):
        assert text == ref.outputs[0].text and finish == ref.outputs[0].finish_reason
    wait_idle(server.engine)
    assert server.engine.stats.num_batched_reqs_max >= 8, server.engine.stats  # continuous batching happened


def _tokens_run(engine) -> int:
    return engine.stats.num_scheduled_tokens_total


def test_client_disconnect_mid_stream_aborts(server):
    wait_idle(server.engine)
    before = _tokens_run(server.engine)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 245, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(line.startswith("data: {") for line in got)
            assert server.engine.num_unfinished() == 1
    wait_idle(server.engine)  # every block back in the pool
    s = server.engine.stats
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == 0
    assert _tokens_run(server.engine) - before < 5 + 200, "the request ran to the end instead of being aborted"


def test_client_disconnect_non_streaming_aborts(llama_ckpt):
    from pagedllm.entrypoints.openai.api_server import build_app

    # the core in this process: its executor is slowed
    server = LiveServer(build_app(make_engine(llama_ckpt, multiprocess=False), served_model_name="tiny",
                                  owns_engine=True))
    try:
        _disconnect_non_streaming(server)
    finally:
        server.stop()


def _disconnect_non_streaming(server):
    wait_idle(server.engine)
    before = _tokens_run(server.engine)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 245, "temperature": 0, "ignore_eos": True}
    executor = server.engine.engine.core.executor
    execute = executor.execute
    executor.execute = lambda so: (time.sleep(0.005), execute(so))[1]  # 245 steps cannot beat the client's timeout
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.15)
        wait_idle(server.engine)
    finally:
        executor.execute = execute
    s = server.engine.stats
    assert s.num_free_blocks == s.num_total_blocks
    assert _tokens_run(server.engine) - before < 5 + 240, "the request ran to the end instead of being aborted"
