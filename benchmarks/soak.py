#!/usr/bin/env python
"""Soak test of ``pagedllm serve``: many requests over mixed endpoints, some aborted, malformed or
hostile, while /health is probed every 100 ms and the server's memory is sampled.

    python benchmarks/soak.py                                   # 10,000 requests, concurrency 64
    python benchmarks/soak.py --num-requests 500 --concurrency 16 --out results/soak.json
    python benchmarks/soak.py -- --kv-cache-memory 256MiB       # flags after -- go to pagedllm serve
    python benchmarks/soak.py --surfaces all --num-requests 3000 --concurrency 16   # every surface

It starts the server itself (the embedded default model unless --model; a free port) and stops it
with SIGTERM at the end. The workload (fixed seed): 20% client aborts (disconnect mid-stream, or
before the answer), 10% malformed requests (bad JSON, wrong types, bad values, wrong content type,
method or route), 5% hostile ones (huge n, huge body, lone surrogates, chat-template bombs, tiny
deadlines, unknown fields, deep nesting, overlong prompts, out-of-vocabulary ids, huge headers),
the rest well-formed: completions and chat (streamed or not), /tokenize, /detokenize,
/v1/models. Issue 29's classes are among the hostile ones: structured-output bombs (1 MB choices,
distinct per request; 4 KB regexes; 900-deep and 100k-enum schemas; deep nesting inside a
guided_json string; a grammar without a terminal), tool bombs (1,000 / 10,000 tools with
tool_choice "required"; deep tool-call arguments), beam parameter extremes (length_penalty
+-1e308, 1100, -2000, -Infinity; best_of 1e9; 100 prompts), logprob amplification (n x
prompt_logprobs, echo x logprobs), the LoRA routes' bodies (huge, bad JSON, 10 KB names with
newlines) and HEAD /health. ``--router``: the server runs with an API key behind ``pagedllm
router --api-key`` and every request goes through the router (with the key), plus a "router"
category sent without it (huge bodies, 2 MB prompts, /tokenize, the LoRA routes): all 401. Malformed and hostile requests must get 4xx (a deadline may also finish in time:
2xx); nothing may get 5xx. A separate process probes /health every 100 ms (the longest time
without a 200 is reported) and samples the server's resident memory (its process tree, from
/proc). ``--warmup`` well-formed requests go first; the RSS after them is the baseline the end
is held to (``--rss-tolerance``, default within 20%). At the end running/waiting requests and
KV cache usage from /metrics must be back to 0.

``--surfaces all`` (or a comma list: responses, tools, structured, beam, lora, kv_tier, images,
pooling; benchmarks/soak_surfaces.py) mixes every surface a user hits into the same soak: the
generating server runs with two LoRA adapters built at start-up, tools and the disk KV offload
tier, a tiny LLaVA server takes the images and two tiny pooling servers (an embedding model and
a cross-encoder) the pooling routes, all started side by side; the default mix above keeps the
share the surfaces leave (40% with all of them). Responses flows (create, read back, follow up,
poll a background one, cancel, delete) are one row each, their calls judged one by one. Every
server is held to the same rules: its own /health probe, RSS (at ready, after the warm-up, at the
end), idle /metrics and exit status; a per-server table follows the per-kind one.

Prints a table per request kind and writes JSON (with the CPU, via common.write_json). Exits 1 if
any request got a 5xx (or an error event in a stream), timed out, or the server did not return
to idle or exited badly, /health answered anything but 200 (the engine died) or went longer than
``--health-limit-s`` without a 200 or its answers' p99 passed ``--health-p99-limit-s`` (1 s), or
the RSS ended above the tolerance -- on any of the servers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import soak_surfaces as surf  # noqa: E402
from common import print_table, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "First Citizen:\nBefore we proceed any further, hear me speak.",
           "KING RICHARD III:\nNow is the winter of our discontent", "MENENIUS:\nWhat work's, my countrymen,",
           "HAMLET:\nTo be, or not to be", "Speak, friend, and", "the"]
CHATS = ["Who art thou?", "Tell me of the king.", "What news from Verona?", "hi", "Speak the speech, I pray you."]


# ---- the workload --------------------------------------------------------------------------
class Spec:
    """One request: ``kind`` (category/case), how to send it and what it may get back."""

    __slots__ = ("kind", "method", "path", "body", "headers", "stream", "abort", "expect", "server", "flow")

    def __init__(self, kind, method="POST", path="/v1/completions", body=None, headers=None, stream=False,
                 abort=None, expect=("2xx",), server="gen", flow=None):
        self.kind, self.method, self.path, self.body = kind, method, path, body
        self.headers = headers or {}
        self.stream, self.abort, self.expect = stream, abort, expect
        # server: which of the soak's servers gets it (--surfaces); flow: an async function of a
        # soak_surfaces.FlowState making several calls (a stored response read back and deleted)
        self.server, self.flow = server, flow


def _json_body(obj) -> bytes:
    return json.dumps(obj).encode()  # ensure_ascii: a lone surrogate goes out as "\ud800"


def _sampling(rng: random.Random, max_tokens=(2, 24)) -> dict:
    s = {"max_tokens": rng.randint(*max_tokens), "temperature": rng.choice([0, 0.8, 1.0])}
    if rng.random() < 0.1:
        s["n"] = rng.randint(2, 4)
    if rng.random() < 0.2:
        s["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.1:
        s["top_p"] = 0.9
    if rng.random() < 0.1:
        s["stop"] = ["\n\n"]
    return s


def normal_spec(rng: random.Random, kind: str) -> Spec:
    if kind in ("completion", "completion_stream"):
        body = {"model": "tiny-shakespeare", "prompt": rng.choice(PROMPTS), **_sampling(rng)}
        if rng.random() < 0.1:
            body["logprobs"] = 2
        stream = kind.endswith("stream")
        if stream:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        return Spec("ok/" + kind, body=_json_body(body), stream=stream)
    if kind in ("chat", "chat_stream"):
        body = {"messages": [{"role": "user", "content": rng.choice(CHATS)}], **_sampling(rng)}
        stream = kind.endswith("stream")
        if stream:
            body["stream"] = True
        return Spec("ok/" + kind, path="/v1/chat/completions", body=_json_body(body), stream=stream)
    if kind == "tokenize":
        body = {"prompt": rng.choice(PROMPTS)} if rng.random() < 0.7 else \
            {"messages": [{"role": "user", "content": rng.choice(CHATS)}]}
        return Spec("ok/tokenize", path="/tokenize", body=_json_body(body))
    if kind == "detokenize":
        return Spec("ok/detokenize", path="/detokenize", body=_json_body({"tokens": [rng.randrange(3, 60)
                                                                                   for _ in range(8)]}))
    if kind == "models":
        return Spec("ok/models", method="GET", path="/v1/models")
    raise ValueError(kind)


NORMAL_KINDS = [("completion", 20), ("completion_stream", 20), ("chat", 15), ("chat_stream", 15),
                ("tokenize", 12), ("detokenize", 6), ("models", 12)]


def abort_spec(rng: random.Random) -> Spec:
    """A generation the client gives up on: mid-stream (after a first chunk) or before any answer."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.6
    if chat:
        body = {"messages": [{"role": "user", "content": rng.choice(CHATS)}]}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": rng.choice(PROMPTS)}
        path = "/v1/completions"
    body.update(_sampling(rng, max_tokens=(64, 200)))
    body["stream"] = stream
    if stream and rng.random() < 0.5:
        how = ("mid_stream", rng.randint(1, 4))  # chunks read before disconnecting
    else:
        how = ("before_answer", rng.uniform(0.005, 0.15))  # seconds before disconnecting
    kind = f"abort/{how[0]}_{'chat' if chat else 'completion'}{'_stream' if stream else ''}"
    return Spec(kind, path=path, body=_json_body(body), stream=stream, abort=how, expect=("2xx", "4xx"))


def _nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 1}'


MALFORMED = [
    ("bad_json", "/v1/completions", b'{"prompt": "ROMEO:", "max_tokens": ', None),
    ("empty_body", "/v1/completions", b"", None),
    ("not_an_object", "/v1/chat/completions", b"[1, 2, 3]", None),
    ("max_tokens_string", "/v1/completions", _json_body({"prompt": "a", "max_tokens": "ten"}), None),
    ("max_tokens_bool", "/v1/completions", _json_body({"prompt": "a", "max_tokens": True}), None),
    ("temperature_string", "/v1/completions", _json_body({"prompt": "a", "temperature": "hot"}), None),
    ("messages_string", "/v1/chat/completions", _json_body({"messages": "hi"}), None),
    ("negative_temperature", "/v1/completions", _json_body({"prompt": "a", "temperature": -1}), None),
    ("top_p_5", "/v1/completions", _json_body({"prompt": "a", "top_p": 5}), None),
    ("negative_max_tokens", "/v1/completions", _json_body({"prompt": "a", "max_tokens": -5}), None),
    ("missing_prompt", "/v1/completions", b"{}", None),
    ("missing_messages", "/v1/chat/completions", _json_body({"max_tokens": 3}), None),
    ("missing_role", "/v1/chat/completions", _json_body({"messages": [{"content": "x"}], "max_tokens": 2}), None),
    ("unknown_model", "/v1/completions", _json_body({"model": "no-such-model", "prompt": "a"}), None),
    ("logprobs_100", "/v1/completions", _json_body({"prompt": "a", "logprobs": 100}), None),
    ("stop_number", "/v1/completions", _json_body({"prompt": "a", "stop": 5}), None),
    ("n_zero", "/v1/completions", _json_body({"prompt": "a", "n": 0}), None),
    ("invalid_utf8", "/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}', None),
    ("tokenize_bad_tokens", "/tokenize", _json_body({"prompt": 12}), None),
    ("detokenize_negative", "/detokenize", _json_body({"tokens": [-5, 3]}), None),
    ("text_plain", "/v1/completions", b"prompt=ROMEO", {"content-type": "text/plain"}),
    ("wrong_method", "GET /v1/completions", None, None),
    ("unknown_route", "/v1/nothing", _json_body({"prompt": "a"}), None),
]


def malformed_spec(i: int) -> Spec:
    name, path, body, headers = MALFORMED[i % len(MALFORMED)]
    method = "POST"
    if " " in path:
        method, path = path.split(" ")
    return Spec("malformed/" + name, method=method, path=path, body=body, headers=headers, expect=("4xx",))


def hostile_specs(huge_body_bytes: int) -> list[tuple[str, str, bytes, dict | None, tuple]]:
    four = ("4xx",)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return [
        ("huge_n", "/v1/completions", _json_body({"prompt": "a", "n": 50000, "max_tokens": 1}), None, four),
        ("huge_n_chat", "/v1/chat/completions", _json_body({**chat, "n": 100000}), None, four),
        ("huge_body", "/v1/completions", b'{"prompt": "' + b"w " * (huge_body_bytes // 2) + b'", "max_tokens": 1}',
         None, four),
        ("lone_surrogate_prompt", "/v1/completions", _json_body({"prompt": "\ud800", "max_tokens": 1}), None, four),
        ("lone_surrogate_model", "/v1/completions", _json_body({"model": "\udfff", "prompt": "a"}), None, four),
        ("lone_surrogate_tokenize", "/tokenize", _json_body({"prompt": "x\ud800y"}), None, four),
        ("lone_surrogate_chat", "/v1/chat/completions",
         _json_body({"messages": [{"role": "user", "content": "\udc00"}]}), None, four),
        ("template_bomb", "/v1/chat/completions", _json_body({**chat, "chat_template": "{{ 'ab' * 100000000 }}"}),
         None, four),
        ("template_loop", "/v1/chat/completions", _json_body({
            **chat, "chat_template": "{% for i in range(100000) %}{% for j in range(3000) %}x{% endfor %}{% endfor %}"}),
         None, four),
        ("deadline_header", "/v1/completions", _json_body({"prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True}),
         {"x-request-timeout": "0.01"}, ("2xx", "408")),
        ("deadline_field_stream", "/v1/chat/completions",
         _json_body({**chat, "max_tokens": 200, "stream": True, "timeout": 0.01, "ignore_eos": True}), None,
         ("2xx", "408")),
        ("deadline_header_garbage", "/v1/completions", _json_body({"prompt": "a", "max_tokens": 1}),
         {"x-request-timeout": "soon"}, four),
        ("unknown_field", "/v1/completions", _json_body({"prompt": "a", "frobnicate": {"x": 1}}), None, four),
        ("unsupported_tools", "/v1/chat/completions", _json_body({**chat, "tools": [{"type": "function"}]}), None,
         four),
        ("huge_max_tokens", "/v1/completions", _json_body({"prompt": "a", "max_tokens": 10 ** 12}), None, four),
        ("token_ids_out_of_vocab", "/v1/completions", _json_body({"prompt": [10 ** 9, -1], "max_tokens": 1}), None,
         four),
        ("deep_nesting", "/v1/completions", _nested(100000), None, four),
        ("overlong_prompt", "/v1/completions", _json_body({"prompt": "w " * 200000, "max_tokens": 1}), None, four),
        ("huge_logit_bias", "/v1/completions",
         _json_body({"prompt": "a", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(200000)}}), None, four),
        ("huge_header", "/v1/models", None, {"x-junk": "j" * 1000000}, four),
        *issue29_specs(huge_body_bytes),
    ]


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{k}", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}} for k in range(n)]


def issue29_specs(huge_body_bytes: int) -> list:
    """Issue 29's hostile classes. A body may be a function of the request's index (distinct
    requests, which a compile cache cannot absorb)."""
    four, either = ("4xx",), ("2xx", "4xx")
    one = {"prompt": "ROMEO:", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    deep = "[" * 20000 + "]" * 20000
    ids500 = list(range(3, 503))
    beam = {"prompt": "ROMEO:", "max_tokens": 3, "n": 2, "use_beam_search": True}
    lora = "/v1/load_lora_adapter"
    return [
        ("so_choice_1mb_distinct", "/v1/completions",
         lambda i: _json_body({**one, "guided_choice": ["x" * (1 << 20) + str(i), "y"]}), None, either),
        ("so_regex_4kb_distinct", "/v1/completions",
         lambda i: _json_body({**one, "guided_regex": "(" + "|".join(f"w{i}_{k}[a-z]{{1,3}}" for k in range(400))
                                                       + ")+"}), None, either),
        ("so_schema_900_deep", "/v1/completions", _json_body({**one, "guided_json": _deep_schema(900)}), None,
         either),
        ("so_enum_100k", "/v1/completions", _json_body({**one, "guided_json": {"enum": [str(k) for k in range(100000)]}}),
         None, either),
        ("so_json_string_deep", "/v1/completions", _json_body({**one, "guided_json": deep}), None, four),
        ("so_grammar_no_terminal", "/v1/completions", _json_body({**one, "guided_grammar": "root ::= a\na ::= root"}),
         None, four),
        ("tools_required_1k", "/v1/chat/completions", _json_body({**chat, "tools": _tools(1000),
                                                                  "tool_choice": "required"}), None, either),
        ("tools_required_10k", "/v1/chat/completions", _json_body({**chat, "tools": _tools(10000),
                                                                   "tool_choice": "required"}), None, either),
        ("tool_args_deep", "/v1/chat/completions", _json_body({"max_tokens": 1, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]}), None, four),
        *[(f"beam_length_penalty_{v:g}", "/v1/completions", _json_body({**beam, "length_penalty": v}), None, either)
          for v in (1100.0, -2000.0, 1e308, -1e308)],
        ("beam_length_penalty_-inf", "/v1/completions",
         b'{"prompt": "a", "max_tokens": 3, "n": 2, "use_beam_search": true, "length_penalty": -Infinity}', None,
         four),
        ("beam_100_prompts", "/v1/completions", _json_body({**beam, "prompt": ["ROMEO:"] * 100}), None, either),
        ("best_of_1e9", "/v1/completions", _json_body({**one, "best_of": 10 ** 9}), None, four),
        ("prompt_logprobs_x_n", "/v1/completions", _json_body({"prompt": ids500, "max_tokens": 1, "n": 128,
                                                               "prompt_logprobs": 20}), None, either),
        ("echo_x_logprobs", "/v1/completions", _json_body({"prompt": ids500, "max_tokens": 1, "n": 32, "echo": True,
                                                           "logprobs": 20}), None, either),
        ("logit_bias_key_5_0", "/v1/completions", _json_body({**one, "logit_bias": {"5_0": 1}}), None, four),
        ("lora_huge_body", lora, b'{"lora_name": "' + b"n" * huge_body_bytes + b'", "lora_path": "/x"}', None, four),
        ("lora_small_body", lora, _json_body({"lora_name": "x", "lora_path": "/nowhere"}), None, four),
        ("lora_unload", "/v1/unload_lora_adapter", _json_body({"lora_name": "x"}), None, four),
        ("lora_bad_json", lora, b'{"lora_name": ', None, four),
        ("lora_name_10kb_newlines", lora, _json_body({"lora_name": "a\n" * 5000, "lora_path": "/x"}), None, four),
        ("head_health", "HEAD /health", None, None, ("2xx",)),
    ]


def router_specs(huge_body_bytes: int) -> list:
    """Sent to the router without its API key: refused (401) before a body is read or forwarded."""
    no = ("401",)
    return [
        ("no_key_huge_body", "/v1/completions", b'{"prompt": "' + b"w " * (huge_body_bytes // 2) + b'"}', None, no),
        ("no_key_prompt_2mb", "/v1/completions", _json_body({"prompt": "w " * (1 << 20), "max_tokens": 1}), None, no),
        ("no_key_chat_2mb", "/v1/chat/completions",
         _json_body({"messages": [{"role": "user", "content": "w " * (1 << 20)}]}), None, no),
        ("no_key_tokenize_huge", "/tokenize", b'{"prompt": "' + b"w" * huge_body_bytes + b'"}', None, no),
        ("no_key_detokenize", "/detokenize", _json_body({"tokens": [5, 6]}), None, no),
        ("no_key_models", "GET /v1/models", None, None, no),
        ("no_key_lora", "/v1/load_lora_adapter", _json_body({"lora_name": "x", "lora_path": "/x"}), None, no),
        ("wrong_key", "/v1/completions", _json_body({"prompt": "a", "max_tokens": 1}),
         {"authorization": "Bearer wrong"}, no),
    ]


def hostile_spec(i: int, cases, category: str = "hostile") -> Spec:
    name, path, body, headers, expect = cases[i % len(cases)]
    if callable(body):
        body = body(i)
    method = "GET" if body is None else "POST"
    if " " in path:
        method, path = path.split(" ")
    stream = b'"stream": true' in (body or b"")
    return Spec(f"{category}/" + name, method=method, path=path, body=body, headers=headers, stream=stream,
                expect=expect)


def workload(n: int, seed: int, huge_body_bytes: int, router: bool = False, surfaces=None) -> list[Spec]:
    """20% aborts, 10% malformed, 5% hostile (7% with ``router``: 2% sent to it without a key).
    ``surfaces`` (a soak_surfaces.Context): that mix is soak_surfaces.base_share() of the
    requests, the rest the surfaces' own."""
    rng = random.Random(seed)
    hostile = hostile_specs(huge_body_bytes)
    no_key = router_specs(huge_body_bytes) if router else []
    names, weights = zip(*NORMAL_KINDS)
    specs, n_mal, n_host, n_router = [], 0, 0, 0
    share = surf.base_share(surfaces.surfaces) if surfaces else 1.0
    for i in range(n):
        r = rng.random()
        if surfaces:
            if r >= share:
                specs.append(surf.surface_spec(rng, r, i, surfaces, Spec))
                continue
            r /= share  # the default mix within its share
        if router and r >= 0.98:
            specs.append(hostile_spec(n_router, no_key, "router"))
            n_router += 1
        elif r < 0.20:
            specs.append(abort_spec(rng))
        elif r < 0.30:
            specs.append(malformed_spec(n_mal))
            n_mal += 1
        elif r < 0.35:
            specs.append(hostile_spec(n_host, hostile))
            n_host += 1
        else:
            specs.append(normal_spec(rng, rng.choices(names, weights)[0]))
    return specs


# ---- sending -------------------------------------------------------------------------------
def _status_class(status: int) -> str:
    return f"{status // 100}xx"


async def send(client, base: str, spec: Spec, timeout: float, api_key: str | None = None) -> dict:
    """Send one request; the outcome: status (or 'aborted' / an exception name), error events seen
    in a 200 stream, and the latency. ``api_key``: sent with every request but the router
    category's."""
    headers = dict(spec.headers)
    if api_key and not spec.kind.startswith("router/"):
        headers["authorization"] = f"Bearer {api_key}"
    if spec.body is not None and "content-type" not in headers:
        headers["content-type"] = "application/json"
    t0 = time.perf_counter()
    out = {"kind": spec.kind, "status": None, "outcome": None, "stream_error": None}
    if spec.flow is not None:
        return await send_flow(client, base, spec, timeout, headers, out, t0)

    async def run():
        req = client.build_request(spec.method, base + spec.path, content=spec.body, headers=headers)
        resp = await client.send(req, stream=True)
        try:
            out["status"] = resp.status_code
            if spec.stream and resp.status_code == 200:
                chunks = 0
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        out["done"] = True
                        break
                    chunks += 1
                    if '"error"' in data:
                        try:
                            err = json.loads(data).get("error")
                        except ValueError:
                            err = None
                        if err:
                            out["stream_error"] = f"{err.get('code')}"
                    if spec.abort and spec.abort[0] == "mid_stream" and chunks >= spec.abort[1]:
                        out["outcome"] = "aborted"
                        return  # leaving the block unread closes the connection
            else:
                await resp.aread()
                if resp.status_code >= 400 and spec.method != "HEAD":  # a HEAD answer has no body
                    out["error_shape_ok"] = _error_shape_ok(resp.content)
        finally:
            await resp.aclose()

    try:
        if spec.abort and spec.abort[0] == "before_answer":
            try:
                await asyncio.wait_for(run(), spec.abort[1])
            except asyncio.TimeoutError:
                out["outcome"] = "aborted"
        else:
            await asyncio.wait_for(run(), timeout)
    except asyncio.TimeoutError:
        out["outcome"] = "client_timeout"
    except Exception as e:  # noqa: BLE001 -- every failure is a result here
        out["outcome"] = "conn_" + type(e).__name__
    out["latency_s"] = time.perf_counter() - t0
    if out["outcome"] is None:
        out["outcome"] = str(out["status"]) + (f"+error:{out['stream_error']}" if out["stream_error"] else "")
    return out


async def send_flow(client, base: str, spec: Spec, timeout: float, headers: dict, out: dict, t0: float) -> dict:
    """A request of several calls (soak_surfaces' flows): its calls' statuses, in order, are the
    outcome; ``steps`` keeps them with what each may get for judge()."""
    st = surf.FlowState(client, base, {k: v for k, v in headers.items() if k != "content-type"})
    try:
        await asyncio.wait_for(spec.flow(st), timeout)
    except asyncio.TimeoutError:
        out["outcome"] = "client_timeout"
    except Exception as e:  # noqa: BLE001 -- every failure is a result here
        out["outcome"] = "conn_" + type(e).__name__
    out["latency_s"] = time.perf_counter() - t0
    out["steps"] = [(name, status, list(expect)) for name, status, expect in st.steps]
    out["http_requests"] = len(st.steps) + (1 if out["outcome"] else 0)
    out["status"] = st.steps[-1][1] if st.steps else None
    out["stream_error"] = st.error
    if out["outcome"] is None:
        out["outcome"] = ("aborted:" if st.aborted else "") + surf.outcome_of(st.steps) + (
            f"+error:{st.error}" if st.error else "")
    return out


def _error_shape_ok(body: bytes) -> bool:
    """An OpenAI-shaped error: {"error": {"message", "type", "code" (not null), ...}}."""
    try:
        err = json.loads(body)["error"]
        return bool(err["message"]) and bool(err["type"]) and err["code"] is not None
    except (ValueError, KeyError, TypeError):
        return False


def judge(spec: Spec, out: dict) -> str:
    """ok, server_error (5xx or an error event with a 5xx-like code), stall (no answer in time), or
    unexpected (an answer of another class than expected)."""
    status, outcome = out["status"], out["outcome"]
    if out.get("steps") is not None:  # a flow: each call judged
        if any(s is not None and s >= 500 for _, s, _ in out["steps"]) or out["stream_error"]:
            return "server_error"
        if outcome == "client_timeout":
            return "stall"
        if outcome.startswith("conn_"):
            return "unexpected"
        return "ok" if all(_status_class(s) in exp or str(s) in exp for _, s, exp in out["steps"]) else "unexpected"
    if status is not None and status >= 500:
        return "server_error"
    if out["stream_error"] in ("request_failed", "internal_error", "engine_dead", "server_error"):
        return "server_error"
    if outcome == "client_timeout":
        return "stall"
    if outcome == "aborted":
        return "ok"
    if status is None:
        # The server closed the connection: acceptable only when it refused the request itself
        # (a body over the limit may be cut while still uploading).
        return "ok" if spec.kind in ("hostile/huge_body", "hostile/huge_header", "hostile/lora_huge_body") \
            or spec.kind.startswith("router/no_key") or "closed" in spec.expect else "unexpected"
    cls = _status_class(status)
    if cls in spec.expect or str(status) in spec.expect:
        return "ok"
    if spec.stream and status == 200 and out["stream_error"] in ("request_timeout",) and "408" in spec.expect:
        return "ok"
    return "unexpected"


async def drive(base, specs: list[Spec], concurrency: int, timeout: float,
                api_key: str | None = None) -> list[dict]:
    """``base``: the URL of the server, or {server name: URL} (each spec goes to its ``server``)."""
    import httpx

    bases = base if isinstance(base, dict) else {"gen": base}

    # idle connections dropped after 2 s, before the server's 5 s keep-alive timeout closes them: a
    # request written on a connection the server is closing at that moment would fail with a reset
    # that is the race's, not the server's
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency,
                          keepalive_expiry=2.0)
    results: list[dict] = [None] * len(specs)  # type: ignore[list-item]
    nxt = iter(range(len(specs)))
    done = [0]
    t0 = time.perf_counter()

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
        async def worker():
            for i in nxt:
                started = time.time()
                out = await send(client, bases[specs[i].server], specs[i], timeout, api_key)
                out["wall"] = (started, time.time())  # to tell what was in flight during a /health gap
                out["server"] = specs[i].server
                out["verdict"] = judge(specs[i], out)
                results[i] = out
                done[0] += 1
                if done[0] % 1000 == 0:
                    print(f"  {done[0]}/{len(specs)} requests, {time.perf_counter() - t0:.0f} s", flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


# ---- the server, /health and memory --------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return None, ""


def _process_tree(pids):
    """(pid, resident bytes, command-line words) of every process in the trees under ``pids``
    (Linux /proc; processes that ended meanwhile are skipped)."""
    stack = list(pids)
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                m = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
            with open(f"/proc/{p}/cmdline", "rb") as f:
                args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
        yield p, int(m.group(1)) * 1024 if m else 0, args


def tree_rss(pids) -> int:
    """Resident bytes of ``pids`` and their descendants."""
    return sum(rss for _, rss, _ in _process_tree(pids))


def rss_by_process(pids) -> dict:
    """MiB resident per process of the trees under ``pids``, keyed 'pid command' (where it goes)."""
    out = {}
    for p, rss, args in _process_tree(pids):
        what = next((a for a in args if a in ("serve", "router")), None) or (
            "engine core / worker" if any("spawn_main" in a for a in args) else " ".join(args)[-40:])
        out[f"{p} {what}"] = round(rss / (1 << 20), 1)
    return out


def monitor(url: str, pids: list[int], interval: float, stop, conn) -> None:
    """In its own process: GET /health every ``interval`` s (5 s timeout) and the server's RSS every
    0.5 s until ``stop`` is set; sends back the probe counts, the longest time without a 200 (and
    the wall-clock time it began), the answer times' p50 / p99 and the RSS samples (each
    process's every 5 s)."""
    from common import HealthProbe

    health = HealthProbe(url, timeout=5)
    probes, non200, failures, latencies = 0, Counter(), 0, []
    t_start = last_ok = time.monotonic()
    longest, longest_at, slowest = 0.0, None, 0.0
    rss, next_rss, by_process, next_by_process = [], 0.0, [], 0.0
    wall = time.time() - t_start  # monotonic -> wall clock
    while not stop.is_set():
        t = time.monotonic()
        code = health.status()
        now = time.monotonic()
        probes += 1
        slowest = max(slowest, now - t)
        latencies.append(now - t)
        if code == 200:
            if now - last_ok > longest:
                longest, longest_at = now - last_ok, last_ok - t_start
            last_ok = now
        else:
            non200[str(code)] += 1
            failures += 1
        if now >= next_rss:
            rss.append((now - t_start, tree_rss(pids)))
            next_rss = now + 0.5
        if now >= next_by_process:
            by_process.append((round(now - t_start, 1), rss_by_process(pids)))
            next_by_process = now + 5.0
        time.sleep(max(0.0, interval - (time.monotonic() - t)))
    now = time.monotonic()
    if now - last_ok > longest:
        longest, longest_at = now - last_ok, last_ok - t_start
    conn.send({"probes": probes, "non_200": dict(non200), "longest_gap_s": longest, "slowest_probe_s": slowest,
               "p50_s": _pct(latencies, 0.5), "p99_s": _pct(latencies, 0.99),
               "longest_gap_starts_at_s": longest_at,
               "longest_gap_wall": (wall + t_start + longest_at, wall + t_start + longest_at + longest)
               if longest_at is not None else None, "rss": rss, "rss_by_process_timeline": by_process})
    conn.close()


def scrape(base: str) -> dict:
    """running, waiting, KV usage and finished-sequence counters from /metrics (any prefix)."""
    _, text = _get(base + "/metrics")
    out: dict = {"finished": {}}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"[a-zA-Z_]+:(\w+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                    "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total"):
            out[name] = out.get(name, 0.0) + value
        elif name.startswith(("kv_offload_", "external_prefix_cache_")) and not name.endswith(
                ("_created", "_bucket")):  # the KV offload tier (--kv-offloading-size)
            out.setdefault("kv_tier", {})[name] = out.get("kv_tier", {}).get(name, 0.0) + value
        elif name == "request_success_total":
            reason = re.search(r'finished_reason="(\w+)"', labels)
            if reason:
                out["finished"][reason.group(1)] = out["finished"].get(reason.group(1), 0) + value
    return out


def wait_idle(base: str, timeout: float) -> tuple[dict, float | None]:
    t0 = time.monotonic()
    while True:
        m = scrape(base)
        idle = m.get("num_requests_running") == 0 and m.get("num_requests_waiting") == 0 \
            and m.get("kv_cache_usage_perc") == 0
        if idle:
            return m, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return m, None
        time.sleep(0.2)


def serve_cmd(model: str | None, served_name: str, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve"] + ([model] if model else []) + [
        "--log-level", "info", "--served-model-name", served_name] + flags


def launch_server(cmd: list[str], log_path: str):
    """Start ``cmd`` + ``--port`` (a free one): (process, base URL, the command, start time)."""
    port = free_port()
    cmd = cmd + ["--port", str(port)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", cmd, time.monotonic()


def wait_ready(proc, base: str, t0: float, timeout: float, log_path: str) -> float:
    """Seconds from the start until its /health answered 200."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log_path}")
        if _get(base + "/health", timeout=1)[0] == 200:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise RuntimeError(f"server not ready after {timeout} s; log: {log_path}")
        time.sleep(0.05)


def start_server(model: str | None, extra: list[str], log_path: str, timeout: float, cmd=None):
    """``pagedllm serve`` (or ``cmd`` + ``--port``) until its /health answers 200."""
    if cmd is None:
        cmd = serve_cmd(model, "tiny-shakespeare", extra)
    proc, base, cmd, t0 = launch_server(cmd, log_path)
    return proc, base, cmd, wait_ready(proc, base, t0, timeout, log_path)


def stop_server(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ---- report --------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def summarize(results: list[dict]) -> list[dict]:
    by_kind = defaultdict(list)
    for r in results:
        by_kind[r["kind"]].append(r)
    rows = []
    for kind in sorted(by_kind):
        rs = by_kind[kind]
        outcomes = Counter(r["outcome"] for r in rs)
        verdicts = Counter(r["verdict"] for r in rs)
        lat = [r["latency_s"] for r in rs]
        rows.append({"kind": kind, "n": len(rs),
                     "outcomes": " ".join(f"{k}:{v}" for k, v in sorted(outcomes.items())),
                     "5xx": verdicts.get("server_error", 0), "unexpected": verdicts.get("unexpected", 0),
                     "stalls": verdicts.get("stall", 0),
                     "bad_error_body": sum(1 for r in rs if r.get("error_shape_ok") is False),
                     "p50_ms": round(1000 * _pct(lat, 0.5), 1), "p99_ms": round(1000 * _pct(lat, 0.99), 1)})
    return rows


def _log_facts(log_path: str) -> dict:
    with open(log_path, errors="replace") as f:
        text = f.read()
    m = re.search(r"kernels (loaded \(level \w+|unavailable|disabled)", text)
    k = re.search(r"KV cache:? ([0-9.]+ [KMG]iB)", text)
    return {"tracebacks": text.count("Traceback"), "kernels": m.group(1).replace("loaded (level ", "") if m else None,
            "kv_cache": k.group(1) if k else None}


def _mib(b) -> float | None:
    return round(b / (1 << 20), 1) if b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    ap.add_argument("--base-url", default=None, help="soak a server already running here instead of starting one "
                                                    "(no RSS sampling)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=120.0, help="client-side limit per request (a stall)")
    ap.add_argument("--health-interval", type=float, default=0.1)
    ap.add_argument("--huge-body-mib", type=float, default=8.0, help="size of the hostile huge-body request")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--server-log", default=None, help="the server's output (default: a temporary file; with "
                                                      "--surfaces the other servers' beside it, .llava ...)")
    ap.add_argument("--router", action="store_true",
                    help="the server with an API key behind pagedllm router --api-key; requests go through the router "
                         "(with the key), plus a category sent to it without the key")
    ap.add_argument("--surfaces", default="none",
                    help="all, or a comma list of " + ", ".join(surf.SURFACES) + ": every surface a user hits, each "
                         "server started with the flags that turn them on (images and pooling on servers of their "
                         "own), the default mix taking the share the surfaces leave (benchmarks/soak_surfaces.py); "
                         "default none")
    ap.add_argument("--assets-dir", default=None,
                    help="--surfaces: build (or reuse) the adapters and checkpoints here and keep them (default: a "
                         "temporary directory, removed at the end)")
    ap.add_argument("--warmup", type=int, default=200,
                    help="well-formed requests before the soak; the RSS after them is the baseline")
    ap.add_argument("--warmup-mixed", type=int, default=0,
                    help="after --warmup, this many requests of the soak's own mix (hostile and malformed ones "
                         "included, judged like the rest) before the RSS baseline")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="seconds the server stays idle before each RSS reading (after the warm-up and after the "
                         "soak), so its idle heap trim (pagedllm/heap.py, 5-10 s into an idle stretch) has run")
    ap.add_argument("--rss-tolerance", type=float, default=0.2,
                    help="the RSS at the end may exceed the post-warm-up RSS by this fraction (default 0.2)")
    ap.add_argument("--health-limit-s", type=float, default=1.0,
                    help="the longest time /health may go without a 200 (default 1 s)")
    ap.add_argument("--health-p99-limit-s", type=float, default=1.0,
                    help="the 99th percentile of /health's answer time (default 1 s)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "soak.json"))
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="extra flags for pagedllm serve (after --; with "
                                                                 "--surfaces, for the generating server)")
    args = ap.parse_args()
    extra = [a for a in args.serve_args if a != "--"]
    try:
        surfaces = surf.parse_surfaces(args.surfaces)
    except ValueError as e:
        ap.error(str(e))
    if surfaces and (args.router or args.base_url):
        ap.error("--surfaces starts its own servers: not with --router or --base-url")

    huge = int(args.huge_body_mib * (1 << 20))
    workdir = ctx = None
    plans = {"gen": {"model": args.model, "name": "tiny-shakespeare", "flags": []}}
    if surfaces:
        workdir = args.assets_dir or tempfile.mkdtemp(prefix="pagedllm-soak-surfaces-")
        os.makedirs(workdir, exist_ok=True)
        t = time.monotonic()
        r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "soak_surfaces.py"), "build", workdir,
                            args.model or surf.DEFAULT_MODEL, ",".join(surfaces)], cwd=REPO, capture_output=True,
                           text=True)
        if r.returncode != 0:
            print(r.stdout[-3000:] + r.stderr[-3000:], file=sys.stderr)
            return 2
        assets = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"surfaces {', '.join(surfaces)}: adapters and checkpoints built in {time.monotonic() - t:.1f} s under "
              f"{workdir}")
        ctx = surf.Context(args.seed, surfaces, assets)
        plans = surf.server_plans(surfaces, assets)
        plans["gen"]["model"] = args.model
    # --warmup-mixed: the warm-up is the head of the same mixed workload (the soak is its tail, so
    # every "distinct" body stays distinct): the baseline is taken after the server met each kind once
    specs = workload(args.warmup_mixed + args.num_requests, args.seed, huge, router=args.router, surfaces=ctx)
    warm = [normal_spec(random.Random(args.seed + 1 + k), "completion") for k in range(args.warmup)]
    if ctx:  # and each surface's well-formed requests, on every server
        warm += surf.warmup_specs(args.seed, ctx, Spec)
    warm, specs = warm + specs[:args.warmup_mixed], specs[args.warmup_mixed:]
    log_path = args.server_log or tempfile.mkstemp(prefix="pagedllm-soak-", suffix=".log")[1]
    # name -> {proc, base (where requests go), server_base (/health, /metrics, RSS), pids, log, cmd, ready_s}
    servers: dict[str, dict] = {}
    router_proc, api_key = None, None
    try:
        if args.base_url:
            base = args.base_url.rstrip("/")
            servers["gen"] = {"proc": None, "base": base, "server_base": base, "pids": [os.getpid()], "log": None,
                              "cmd": None, "ready_s": None}
        else:
            if args.router:
                api_key = "soak-" + os.urandom(8).hex()
                extra = extra + ["--api-key", api_key]
            launched = {}
            for name, plan in plans.items():  # all at once: they load side by side
                log = log_path if name == "gen" else f"{log_path}.{name}"
                cmd = serve_cmd(plan["model"], plan["name"], plan["flags"] + (extra if name == "gen" else []))
                launched[name] = (*launch_server(cmd, log), log)
            for name, (proc, base, cmd, t0, log) in launched.items():
                servers[name] = {"proc": proc, "base": base, "server_base": base, "pids": [proc.pid], "log": log,
                                 "cmd": cmd, "ready_s": None}
            for name, (proc, base, cmd, t0, log) in launched.items():
                servers[name]["ready_s"] = wait_ready(proc, base, t0, args.startup_timeout, log)
                print(f"server {name} ready after {servers[name]['ready_s']:.1f} s at {base} (log: {log})")
        gen = servers["gen"]
        if args.router and gen["proc"]:
            router_cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "router", "--backends", gen["base"],
                          "--api-key", api_key, "--routing", "least_loaded", "--log-level", "warning",
                          "--max-request-body-size", str(4 << 20)]
            router_proc, gen["base"], _, _ = start_server(None, [], log_path + ".router", args.startup_timeout,
                                                          router_cmd)
            gen["pids"].append(router_proc.pid)
            print(f"router ready at {gen['base']}")
        started = bool(gen["proc"])
        for sv in servers.values():
            sv["rss_ready"] = tree_rss(sv["pids"]) if started else None
        bases = {name: sv["base"] for name, sv in servers.items()}
        warm_verdicts: dict = {}
        if warm:
            for out in asyncio.run(drive(bases, warm, min(args.concurrency, 16), args.request_timeout, api_key)):
                warm_verdicts[out["verdict"]] = warm_verdicts.get(out["verdict"], 0) + 1
                if out["verdict"] != "ok":
                    print(f"  warm-up {out['kind']}: {out['verdict']} ({out['outcome']})")
            for sv in servers.values():
                wait_idle(sv["server_base"], timeout=60)
            time.sleep(args.settle_s)
        for sv in servers.values():
            sv["rss_warm"] = tree_rss(sv["pids"]) if started else None
            sv["rss_warm_by_process"] = rss_by_process(sv["pids"]) if started else None
        mp_ctx = mp.get_context("spawn")
        stop = mp_ctx.Event()
        for sv in servers.values():
            parent, child = mp_ctx.Pipe(duplex=False)
            sv["monitor"] = mp_ctx.Process(target=monitor, args=(sv["server_base"], sv["pids"], args.health_interval,
                                                                  stop, child), daemon=True)
            sv["monitor_conn"] = parent
            sv["monitor"].start()
        time.sleep(0.3)
        for sv in servers.values():
            sv["before"] = scrape(sv["server_base"])
        t0, t_wall0 = time.perf_counter(), time.time()
        results = asyncio.run(drive(bases, specs, args.concurrency, args.request_timeout, api_key))
        elapsed = time.perf_counter() - t0
        for sv in servers.values():
            sv["after"], sv["drained_s"] = wait_idle(sv["server_base"], timeout=60)
        for sv in servers.values():
            sv["rss_idle_at_once"] = tree_rss(sv["pids"]) if started else None
        time.sleep(args.settle_s)
        for sv in servers.values():
            sv["rss_end"] = tree_rss(sv["pids"]) if started else None
            sv["rss_end_by_process"] = rss_by_process(sv["pids"]) if started else None
        stop.set()
        for sv in servers.values():
            sv["health"] = sv["monitor_conn"].recv() if sv["monitor_conn"].poll(30) else {}
            sv["monitor"].join(10)
        if router_proc:
            stop_server(router_proc)
            router_proc = None
        for sv in servers.values():
            sv["exit_code"] = stop_server(sv["proc"]) if sv["proc"] else None
            sv["log_facts"] = _log_facts(sv["log"]) if sv["proc"] else {}
    finally:  # a failure on the way: no server left behind
        for p in [router_proc] + [sv.get("proc") for sv in servers.values()]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if workdir and not args.assets_dir:
            shutil.rmtree(workdir, ignore_errors=True)

    proc = gen["proc"]
    health, after, drained_s, before = gen["health"], gen["after"], gen["drained_s"], gen["before"]
    rss_warm, rss_end, rss_idle_at_once = gen["rss_warm"], gen["rss_end"], gen["rss_idle_at_once"]
    exit_code, facts = gen["exit_code"], gen["log_facts"]
    tracebacks, server_kernels, server_kv_cache = facts.get("tracebacks"), facts.get("kernels"), facts.get("kv_cache")

    rows = summarize(results)
    print()
    print_table(rows, ["kind", "n", "5xx", "unexpected", "stalls", "bad_error_body", "p50_ms", "p99_ms",
                       "outcomes"])
    verdicts = Counter(r["verdict"] for r in results)
    categories = Counter(r["kind"].split("/")[0] for r in results)
    per_server = {}
    for name, sv in servers.items():
        h, rss = sv["health"], sv["health"].get("rss", []) if sv["proc"] else []
        rss_mib = [b / (1 << 20) for _, b in rss]
        growth = round(sv["rss_end"] / sv["rss_warm"] - 1, 3) if sv["rss_warm"] else None
        # what this server had in flight during its longest /health gap (started before the gap
        # ended, ended after it began)
        gap = h.get("longest_gap_wall")
        in_gap = Counter(r["kind"] for r in results if gap and r.get("server") == name
                         and r["wall"][0] <= gap[1] and r["wall"][1] >= gap[0])
        per_server[name] = {
            "requests": sum(1 for s in specs if s.server == name),
            "health_probes": h.get("probes"), "health_non_200": h.get("non_200"),
            "health_p50_s": round(h["p50_s"], 4) if "p50_s" in h else None,
            "health_p99_s": round(h["p99_s"], 4) if "p99_s" in h else None,
            "health_max_s": round(h["slowest_probe_s"], 3) if "slowest_probe_s" in h else None,
            "health_longest_gap_s": round(h["longest_gap_s"], 3) if "longest_gap_s" in h else None,
            "rss_at_ready_mib": _mib(sv["rss_ready"]), "rss_after_warmup_mib": _mib(sv["rss_warm"]),
            "rss_peak_mib": round(max(rss_mib), 1) if rss_mib else None,
            "rss_when_idle_before_settling_mib": _mib(sv["rss_idle_at_once"]),
            "rss_after_idle_mib": _mib(sv["rss_end"]), "rss_growth": growth,
            "rss_by_process_mib": {"after_warmup": sv["rss_warm_by_process"], "after_idle": sv["rss_end_by_process"]},
            "rss_by_process_timeline_mib": h.get("rss_by_process_timeline"),
            "health_longest_gap_in_flight": dict(in_gap.most_common(12)),
            "idle_at_end": sv["drained_s"] is not None, "drained_after_s": sv["drained_s"],
            "metrics_after": sv["after"], "exit_code": sv["exit_code"], "log_tracebacks": sv["log_facts"].get(
                "tracebacks"), "log": sv["log"], "cmd": sv["cmd"], "ready_s": sv["ready_s"],
        }
    rss = health.get("rss", []) if proc else []
    rss_mib = [b / (1 << 20) for _, b in rss]
    # Ten points over the run (time s, MiB): growth that flattens is the KV cache's pages being
    # touched for the first time and malloc keeping its peak; a leak keeps climbing.
    timeline = [(round(rss[i][0], 1), round(rss_mib[i], 1))
                for i in sorted({min(len(rss) - 1, k * len(rss) // 10) for k in range(11)})] if rss else []
    summary = {
        "num_requests": len(results), "concurrency": args.concurrency, "seed": args.seed,
        "http_requests": sum(r.get("http_requests", 1) for r in results),
        "elapsed_s": round(elapsed, 2), "requests_per_s": round(len(results) / elapsed, 1),
        "categories": dict(categories), "verdicts": dict(verdicts),
        "status_5xx": verdicts.get("server_error", 0), "unexpected": verdicts.get("unexpected", 0),
        "stalls": verdicts.get("stall", 0),
        "errors_not_openai_shaped": sorted({r["kind"] for r in results if r.get("error_shape_ok") is False}),
        "failing_kinds": sorted({r["kind"] for r in results if r["verdict"] in ("server_error", "stall")}),
        "unexpected_kinds": sorted({f"{r['kind']}:{r['outcome']}" for r in results if r["verdict"] == "unexpected"}),
        "connection_errors": [{"kind": r["kind"], "server": r.get("server"), "outcome": r["outcome"],
                               "latency_s": round(r["latency_s"], 3), "at_s": round(r["wall"][0] - t_wall0, 2)}
                              for r in results if r["outcome"].startswith("conn_")][:50],
        "health_probes": health.get("probes"), "health_non_200": health.get("non_200"),
        "health_longest_gap_s": round(health["longest_gap_s"], 3) if "longest_gap_s" in health else None,
        "health_longest_gap_starts_at_s": health.get("longest_gap_starts_at_s"),
        "health_p50_s": per_server["gen"]["health_p50_s"], "health_p99_s": per_server["gen"]["health_p99_s"],
        "rss_mib": {"start": round(rss_mib[0], 1), "peak": round(max(rss_mib), 1),
                    "end": round(rss_mib[-1], 1)} if rss_mib else None,
        "warmup_requests": len(warm), "warmup_mixed": args.warmup_mixed, "warmup_verdicts": warm_verdicts,
        "router": args.router, "surfaces": list(surfaces),
        "rss_at_ready_mib": per_server["gen"]["rss_at_ready_mib"],
        "rss_after_warmup_mib": round(rss_warm / (1 << 20), 1) if rss_warm else None,
        "rss_after_idle_mib": round(rss_end / (1 << 20), 1) if rss_end else None,
        "rss_growth": round(rss_end / rss_warm - 1, 3) if rss_warm else None,
        "rss_when_idle_before_settling_mib": round(rss_idle_at_once / (1 << 20), 1) if rss_idle_at_once else None,
        "settle_s": args.settle_s,
        "rss_by_process_mib": {"after_warmup": gen["rss_warm_by_process"], "after_idle": gen["rss_end_by_process"]},
        "health_slowest_probe_s": round(health["slowest_probe_s"], 3) if "slowest_probe_s" in health else None,
        "metrics_before": before, "metrics_after": after, "drained_after_s": drained_s,
        "idle_at_end": drained_s is not None,
        "kv_tier": {k: after.get("kv_tier", {}).get(k, 0) - before.get("kv_tier", {}).get(k, 0)
                    for k in after.get("kv_tier", {})} if after.get("kv_tier") else None,
        "rss_timeline_mib": timeline,
        "server_ready_s": gen["ready_s"], "server_kernels": server_kernels, "server_kv_cache": server_kv_cache,
        "server_exit_code": exit_code, "server_log_tracebacks": tracebacks,
        "server_log": log_path if proc else None, "server_cmd": gen["cmd"], "argv": sys.argv,
        "servers": per_server,
        "kinds": rows,
    }
    print()
    print(f"{len(results)} requests ({summary['http_requests']} HTTP requests) at concurrency {args.concurrency} in "
          f"{elapsed:.1f} s ({summary['requests_per_s']} req/s): {dict(categories)}")
    print(f"5xx: {summary['status_5xx']}  stalls: {summary['stalls']}  unexpected status: {summary['unexpected']}"
          + (f" ({', '.join(summary['unexpected_kinds'][:10])})" if summary["unexpected"] else ""))
    if summary["errors_not_openai_shaped"]:
        print(f"4xx bodies not OpenAI-shaped JSON: {', '.join(summary['errors_not_openai_shaped'])}")
    if summary["failing_kinds"]:
        print(f"FAILING kinds: {', '.join(summary['failing_kinds'])}")
    if health:
        print(f"/health: {health['probes']} probes, non-200 {health['non_200'] or 0}, longest gap without a 200 "
              f"{health['longest_gap_s'] * 1000:.0f} ms, p99 {health['p99_s'] * 1000:.0f} ms")
    for name, v in per_server.items():
        if (v["health_longest_gap_s"] or 0) > args.health_limit_s:
            print(f"/health of {name}: its longest gap ({v['health_longest_gap_s']} s) had in flight: "
                  + ", ".join(f"{k} x{c}" for k, c in v["health_longest_gap_in_flight"].items()))
    if rss_warm:
        print(f"RSS after warm-up {summary['rss_after_warmup_mib']} MiB, after the soak (idle) "
              f"{summary['rss_after_idle_mib']} MiB: {100 * summary['rss_growth']:+.1f}% "
              f"(tolerance {100 * args.rss_tolerance:.0f}%)")
    if health:
        print(f"/health: slowest probe {summary['health_slowest_probe_s']} s (limit {args.health_limit_s:g} s)")
    if rss_mib:
        print(f"server RSS (process tree): start {rss_mib[0]:.0f} MiB, peak {max(rss_mib):.0f} MiB, "
              f"end {rss_mib[-1]:.0f} MiB (KV cache {server_kv_cache}); over the run (s: MiB): "
              + ", ".join(f"{t:.0f}: {m:.0f}" for t, m in timeline))
    print(f"/metrics at the end: running {after.get('num_requests_running')}, waiting "
          f"{after.get('num_requests_waiting')}, KV usage {after.get('kv_cache_usage_perc')}"
          + (f" (idle {drained_s:.1f} s after the last answer)" if drained_s is not None else " -- NOT IDLE")
          + f"; finished sequences by reason {after.get('finished')}")
    if summary["kv_tier"]:
        print("KV offload tier over the soak: "
              + ", ".join(f"{k} {v:g}" for k, v in sorted(summary["kv_tier"].items())))
    if proc:
        print(f"server exit code after SIGTERM: {exit_code}; tracebacks in its log: {tracebacks}")
    if len(servers) > 1:
        print()
        print_table([{"server": name, "requests": v["requests"], "health_probes": v["health_probes"],
                      "non_200": sum((v["health_non_200"] or {}).values()),
                      "p99_ms": round(1000 * (v["health_p99_s"] or 0), 1),
                      "max_ms": round(1000 * (v["health_max_s"] or 0)),
                      "gap_ms": round(1000 * (v["health_longest_gap_s"] or 0)),
                      "rss_ready": v["rss_at_ready_mib"], "rss_warm": v["rss_after_warmup_mib"],
                      "rss_peak": v["rss_peak_mib"], "rss_end": v["rss_after_idle_mib"],
                      "growth_%": round(100 * v["rss_growth"], 1) if v["rss_growth"] is not None else None,
                      "idle": v["idle_at_end"], "exit": v["exit_code"], "tracebacks": v["log_tracebacks"]}
                     for name, v in per_server.items()],
                    ["server", "requests", "health_probes", "non_200", "p99_ms", "max_ms", "gap_ms", "rss_ready",
                     "rss_warm", "rss_peak", "rss_end", "growth_%", "idle", "exit", "tracebacks"])
    if args.out:
        print(f"wrote {args.out}")
    every = per_server.values()
    summary_gates = {
        "no_5xx": not summary["status_5xx"], "no_stalls": not summary["stalls"],
        "idle_at_end": all(v["idle_at_end"] for v in every),
        "warmup_all_ok": set(warm_verdicts) <= {"ok"},
        "server_exit_0": not proc or all(v["exit_code"] == 0 for v in every),
        "health_always_200": not any(v["health_non_200"] for v in every),
        "health_within_limit": all((v["health_longest_gap_s"] or 0.0) <= args.health_limit_s for v in every),
        "health_p99_within_limit": all((v["health_p99_s"] or 0.0) <= args.health_p99_limit_s for v in every),
        "rss_within_tolerance": all(v["rss_growth"] is None or v["rss_growth"] <= args.rss_tolerance for v in every),
    }
    failed = [k for k, v in summary_gates.items() if not v]
    print("gates: " + ("all passed" if not failed else "FAILED " + ", ".join(failed)))
    summary["gates"] = summary_gates
    write_json(args.out, summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
