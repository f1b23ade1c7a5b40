#!/usr/bin/env python
"""Soak test of ``pagedllm serve``: many requests over mixed endpoints, some aborted, malformed or
hostile, while /health is probed every 100 ms and the server's memory is sampled.

    python benchmarks/soak.py                                   # 10,000 requests, concurrency 64
    python benchmarks/soak.py --num-requests 500 --concurrency 16 --out results/soak.json
    python benchmarks/soak.py -- --kv-cache-memory 256MiB       # flags after -- go to pagedllm serve

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

Prints a table per request kind and writes JSON (with the CPU, via common.write_json). Exits 1 if
any request got a 5xx (or an error event in a stream), timed out, or the server did not return
to idle or exited badly, /health answered anything but 200 (the engine died) or went longer than
``--health-limit-s`` without a 200, or the RSS ended above the tolerance.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
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
from common import print_table, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "First Citizen:\nBefore we proceed any further, hear me speak.",
           "KING RICHARD III:\nNow is the winter of our discontent", "MENENIUS:\nWhat work's, my countrymen,",
           "HAMLET:\nTo be, or not to be", "Speak, friend, and", "the"]
CHATS = ["Who art thou?", "Tell me of the king.", "What news from Verona?", "hi", "Speak the speech, I pray you."]


# ---- the workload --------------------------------------------------------------------------
class Spec:
    """One request: ``kind`` (category/case), how to send it and what it may get back."""

    __slots__ = ("kind", "method", "path", "body", "headers", "stream", "abort", "expect")

    def __init__(self, kind, method="POST", path="/v1/completions", body=None, headers=None, stream=False,
                 abort=None, expect=("2xx",)):
        self.kind, self.method, self.path, self.body = kind, method, path, body
        self.headers = headers or {}
        self.stream, self.abort, self.expect = stream, abort, expect


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


def workload(n: int, seed: int, huge_body_bytes: int, router: bool = False) -> list[Spec]:
    """20% aborts, 10% malformed, 5% hostile (7% with ``router``: 2% sent to it without a key)."""
    rng = random.Random(seed)
    hostile = hostile_specs(huge_body_bytes)
    no_key = router_specs(huge_body_bytes) if router else []
    names, weights = zip(*NORMAL_KINDS)
    specs, n_mal, n_host, n_router = [], 0, 0, 0
    for _ in range(n):
        r = rng.random()
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
            or spec.kind.startswith("router/no_key") else "unexpected"
    cls = _status_class(status)
    if cls in spec.expect or str(status) in spec.expect:
        return "ok"
    if spec.stream and status == 200 and out["stream_error"] in ("request_timeout",) and "408" in spec.expect:
        return "ok"
    return "unexpected"


async def drive(base: str, specs: list[Spec], concurrency: int, timeout: float,
                api_key: str | None = None) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    results: list[dict] = [None] * len(specs)  # type: ignore[list-item]
    nxt = iter(range(len(specs)))
    done = [0]
    t0 = time.perf_counter()

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
        async def worker():
            for i in nxt:
                out = await send(client, base, specs[i], timeout, api_key)
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
    0.5 s until ``stop`` is set; sends back the probe counts, the longest time without a 200 and
    the RSS samples."""
    from common import HealthProbe

    health = HealthProbe(url, timeout=5)
    probes, non200, failures = 0, Counter(), 0
    t_start = last_ok = time.monotonic()
    longest, longest_at, slowest = 0.0, None, 0.0
    rss, next_rss = [], 0.0
    while not stop.is_set():
        t = time.monotonic()
        code = health.status()
        now = time.monotonic()
        probes += 1
        slowest = max(slowest, now - t)
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
        time.sleep(max(0.0, interval - (time.monotonic() - t)))
    now = time.monotonic()
    if now - last_ok > longest:
        longest, longest_at = now - last_ok, last_ok - t_start
    conn.send({"probes": probes, "non_200": dict(non200), "longest_gap_s": longest, "slowest_probe_s": slowest,
               "longest_gap_starts_at_s": longest_at, "rss": rss})
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


def start_server(model: str | None, extra: list[str], log_path: str, timeout: float, cmd=None):
    """``pagedllm serve`` (or ``cmd`` + ``--port``) until its /health answers 200."""
    port = free_port()
    if cmd is None:
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve"] + ([model] if model else [])
        cmd += ["--log-level", "info", "--served-model-name", "tiny-shakespeare"] + extra
    cmd = cmd + ["--port", str(port)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log_path}")
        if _get(base + "/health", timeout=1)[0] == 200:
            return proc, base, cmd, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise RuntimeError(f"server not ready after {timeout} s; log: {log_path}")
        time.sleep(0.05)


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
    ap.add_argument("--server-log", default=None, help="the server's output (default: a temporary file)")
    ap.add_argument("--router", action="store_true",
                    help="the server with an API key behind pagedllm router --api-key; requests go through the router "
                         "(with the key), plus a category sent to it without the key")
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
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "soak.json"))
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="extra flags for pagedllm serve (after --)")
    args = ap.parse_args()
    extra = [a for a in args.serve_args if a != "--"]

    huge = int(args.huge_body_mib * (1 << 20))
    # --warmup-mixed: the warm-up is the head of the same mixed workload (the soak is its tail, so
    # every "distinct" body stays distinct): the baseline is taken after the server met each kind once
    specs = workload(args.warmup_mixed + args.num_requests, args.seed, huge, router=args.router)
    warm = [normal_spec(random.Random(args.seed + 1 + k), "completion") for k in range(args.warmup)]
    warm, specs = warm + specs[:args.warmup_mixed], specs[args.warmup_mixed:]
    log_path = args.server_log or tempfile.mkstemp(prefix="pagedllm-soak-", suffix=".log")[1]
    proc, server_cmd, ready_s, router_proc, api_key = None, None, None, None, None
    if args.base_url:
        base = args.base_url.rstrip("/")
    else:
        if args.router:
            api_key = "soak-" + os.urandom(8).hex()
            extra = extra + ["--api-key", api_key]
        proc, base, server_cmd, ready_s = start_server(args.model, extra, log_path, args.startup_timeout)
        print(f"server ready after {ready_s:.1f} s at {base} (log: {log_path})")
    server_base = base  # /health, /metrics and RSS: the server itself
    if args.router and proc:
        router_cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "router", "--backends", base,
                      "--api-key", api_key, "--routing", "least_loaded", "--log-level", "warning",
                      "--max-request-body-size", str(4 << 20)]
        router_proc, base, _, _ = start_server(None, [], log_path + ".router", args.startup_timeout, router_cmd)
        print(f"router ready at {base}")
    pids = [p.pid for p in (proc, router_proc) if p] or [os.getpid()]
    warm_verdicts: dict = {}
    if warm:
        for out in asyncio.run(drive(base, warm, min(args.concurrency, 16), args.request_timeout, api_key)):
            warm_verdicts[out["verdict"]] = warm_verdicts.get(out["verdict"], 0) + 1
        wait_idle(server_base, timeout=60)
        time.sleep(args.settle_s)
    rss_warm = tree_rss(pids) if proc else None
    rss_warm_by_process = rss_by_process(pids) if proc else None
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    parent, child = ctx.Pipe(duplex=False)
    mon = ctx.Process(target=monitor, args=(server_base, pids, args.health_interval, stop, child), daemon=True)
    mon.start()
    time.sleep(0.3)
    before = scrape(server_base)
    t0 = time.perf_counter()
    results = asyncio.run(drive(base, specs, args.concurrency, args.request_timeout, api_key))
    elapsed = time.perf_counter() - t0
    after, drained_s = wait_idle(server_base, timeout=60)
    rss_idle_at_once = tree_rss(pids) if proc else None
    time.sleep(args.settle_s)
    rss_end = tree_rss(pids) if proc else None
    rss_end_by_process = rss_by_process(pids) if proc else None
    stop.set()
    health = parent.recv() if parent.poll(30) else {}
    mon.join(10)
    if router_proc:
        stop_server(router_proc)
    exit_code = stop_server(proc) if proc else None
    tracebacks = server_kernels = server_kv_cache = None
    if proc:
        with open(log_path, errors="replace") as f:
            log_text = f.read()
        tracebacks = log_text.count("Traceback")
        m = re.search(r"kernels (loaded \(level \w+|unavailable|disabled)", log_text)
        server_kernels = m.group(1).replace("loaded (level ", "") if m else None
        m = re.search(r"KV cache:? ([0-9.]+ [KMG]iB)", log_text)
        server_kv_cache = m.group(1) if m else None

    rows = summarize(results)
    print()
    print_table(rows, ["kind", "n", "5xx", "unexpected", "stalls", "bad_error_body", "p50_ms", "p99_ms",
                       "outcomes"])
    verdicts = Counter(r["verdict"] for r in results)
    categories = Counter(r["kind"].split("/")[0] for r in results)
    rss = health.get("rss", []) if proc else []
    rss_mib = [b / (1 << 20) for _, b in rss]
    # Ten points over the run (time s, MiB): growth that flattens is the KV cache's pages being
    # touched for the first time and malloc keeping its peak; a leak keeps climbing.
    timeline = [(round(rss[i][0], 1), round(rss_mib[i], 1))
                for i in sorted({min(len(rss) - 1, k * len(rss) // 10) for k in range(11)})] if rss else []
    summary = {
        "num_requests": len(results), "concurrency": args.concurrency, "seed": args.seed,
        "elapsed_s": round(elapsed, 2), "requests_per_s": round(len(results) / elapsed, 1),
        "categories": dict(categories), "verdicts": dict(verdicts),
        "status_5xx": verdicts.get("server_error", 0), "unexpected": verdicts.get("unexpected", 0),
        "stalls": verdicts.get("stall", 0),
        "errors_not_openai_shaped": sorted({r["kind"] for r in results if r.get("error_shape_ok") is False}),
        "failing_kinds": sorted({r["kind"] for r in results if r["verdict"] in ("server_error", "stall")}),
        "unexpected_kinds": sorted({f"{r['kind']}:{r['outcome']}" for r in results if r["verdict"] == "unexpected"}),
        "health_probes": health.get("probes"), "health_non_200": health.get("non_200"),
        "health_longest_gap_s": round(health["longest_gap_s"], 3) if "longest_gap_s" in health else None,
        "health_longest_gap_starts_at_s": health.get("longest_gap_starts_at_s"),
        "rss_mib": {"start": round(rss_mib[0], 1), "peak": round(max(rss_mib), 1),
                    "end": round(rss_mib[-1], 1)} if rss_mib else None,
        "warmup_requests": len(warm), "warmup_mixed": args.warmup_mixed, "warmup_verdicts": warm_verdicts,
        "router": args.router,
        "rss_after_warmup_mib": round(rss_warm / (1 << 20), 1) if rss_warm else None,
        "rss_after_idle_mib": round(rss_end / (1 << 20), 1) if rss_end else None,
        "rss_growth": round(rss_end / rss_warm - 1, 3) if rss_warm else None,
        "rss_when_idle_before_settling_mib": round(rss_idle_at_once / (1 << 20), 1) if rss_idle_at_once else None,
        "settle_s": args.settle_s,
        "rss_by_process_mib": {"after_warmup": rss_warm_by_process, "after_idle": rss_end_by_process},
        "health_slowest_probe_s": round(health["slowest_probe_s"], 3) if "slowest_probe_s" in health else None,
        "metrics_before": before, "metrics_after": after, "drained_after_s": drained_s,
        "idle_at_end": drained_s is not None,
        "rss_timeline_mib": timeline,
        "server_ready_s": ready_s, "server_kernels": server_kernels, "server_kv_cache": server_kv_cache, "server_exit_code": exit_code, "server_log_tracebacks": tracebacks,
        "server_log": log_path if proc else None, "server_cmd": server_cmd, "argv": sys.argv,
        "kinds": rows,
    }
    print()
    print(f"{len(results)} requests at concurrency {args.concurrency} in {elapsed:.1f} s "
          f"({summary['requests_per_s']} req/s): {dict(categories)}")
    print(f"5xx: {summary['status_5xx']}  stalls: {summary['stalls']}  unexpected status: {summary['unexpected']}"
          + (f" ({', '.join(summary['unexpected_kinds'][:10])})" if summary["unexpected"] else ""))
    if summary["errors_not_openai_shaped"]:
        print(f"4xx bodies not OpenAI-shaped JSON: {', '.join(summary['errors_not_openai_shaped'])}")
    if summary["failing_kinds"]:
        print(f"FAILING kinds: {', '.join(summary['failing_kinds'])}")
    if health:
        print(f"/health: {health['probes']} probes, non-200 {health['non_200'] or 0}, longest gap without a 200 "
              f"{health['longest_gap_s'] * 1000:.0f} ms")
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
    if proc:
        print(f"server exit code after SIGTERM: {exit_code}; tracebacks in its log: {tracebacks}")
    if args.out:
        print(f"wrote {args.out}")
    summary_gates = {
        "no_5xx": not summary["status_5xx"], "no_stalls": not summary["stalls"], "idle_at_end": summary["idle_at_end"],
        "warmup_all_ok": set(warm_verdicts) <= {"ok"},
        "server_exit_0": not proc or exit_code == 0,
        "health_always_200": not health.get("non_200"),
        "health_within_limit": health.get("longest_gap_s", 0.0) <= args.health_limit_s,
        "rss_within_tolerance": summary["rss_growth"] is None or summary["rss_growth"] <= args.rss_tolerance,
    }
    failed = [k for k, v in summary_gates.items() if not v]
    print("gates: " + ("all passed" if not failed else "FAILED " + ", ".join(failed)))
    summary["gates"] = summary_gates
    write_json(args.out, summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
