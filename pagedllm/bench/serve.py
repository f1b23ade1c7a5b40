"""``pagedllm bench serve``: drive any OpenAI-compatible server (pagedllm, vLLM, ...) with a
workload and measure what its clients see.

Requests are streamed; arrivals follow a Poisson process at ``--request-rate`` per second (a
gamma process with ``--burstiness`` != 1; ``inf``: all at once), at most ``--max-concurrency``
in flight. TTFT is the time to the first chunk that carries generated text (a chat stream's
first chunk, the role alone, does not count); ITL the gaps between such chunks; TPOT
(latency - TTFT) / (output tokens - 1). A comma-separated ``--request-rate 1,2,4,inf`` runs
one pass per rate.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Optional, Sequence

from pagedllm.bench.datasets import SampleRequest, as_text
from pagedllm.bench.metrics import RequestResult

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in str(text).split(","):
        part = part.strip().lower()
        try:
            rate = math.inf if part == "inf" else float(part)
        except ValueError:
            raise ValueError(f"request_rate must be numbers or inf separated by commas, got {text!r}") from None
        if not rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {part}")
        rates.append(rate)
    if not rates:
        raise ValueError("request_rate is empty")
    return rates


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait after each request before sending the next (gamma intervals of mean
    1/rate; shape ``burstiness``: 1 is Poisson, lower is burstier)."""
    if math.isinf(rate):
        return [0.0] * n
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


def request_body(backend: str, req: SampleRequest, model: Optional[str], *, ignore_eos: bool,
                 temperature: float, extra_body: Optional[dict]) -> dict:
    body: dict = {"max_tokens": req.output_len, "temperature": temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if backend == "openai":
        body["prompt"] = req.prompt
    else:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if extra_body:
        body.update(extra_body)
    return body


def _chunk_text(backend: str, msg: dict) -> str:
    text = ""
    for choice in msg.get("choices") or ():
        if backend == "openai":
            text += choice.get("text") or ""
        else:
            delta = choice.get("delta") or {}
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text


async def send_request(client, url: str, backend: str, body: dict, headers: dict,
                       prompt_len: Optional[int]) -> RequestResult:
    import httpx

    res = RequestResult(prompt_len)
    start = time.perf_counter()
    last = None
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])[:300]
                    return res
                if msg.get("usage"):
                    usage = msg["usage"]
                if not _chunk_text(backend, msg):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    if usage:
        res.output_len = int(usage.get("completion_tokens") or chunks)
        if usage.get("prompt_tokens") is not None:
            res.prompt_len = int(usage["prompt_tokens"])
    else:
        res.output_len = chunks
    res.ok = last is not None
    if not res.ok:
        res.error = "the stream ended without generated text"
    return res


async def first_model(client, base_url: str, headers: dict) -> str:
    r = await client.get(base_url + "/v1/models", headers=headers)
    if r.status_code != 200:
        raise ValueError(f"GET {base_url}/v1/models: HTTP {r.status_code}; give --model")
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; give --model")
    return data[0]["id"]


async def run_pass(client, url: str, backend: str, reqs: Sequence[SampleRequest], model: Optional[str],
                   headers: dict, rate: float, *, burstiness: float, max_concurrency: Optional[int], seed: int,
                   ignore_eos: bool, temperature: float, extra_body: Optional[dict],
                   progress: bool) -> tuple[list[RequestResult], float]:
    """One pass over the workload at one request rate: (the requests' results, wall seconds)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc=f"rate {rate:g}/s", unit="req")

    async def send(req: SampleRequest, t0: float) -> RequestResult:
        body = request_body(backend, req, model, ignore_eos=ignore_eos, temperature=temperature,
                            extra_body=extra_body)
        sent = time.perf_counter() - t0
        res = await send_request(client, url, backend, body, headers, req.prompt_len)
        res.start = sent
        return res

    async def one(req: SampleRequest, t0: float) -> RequestResult:
        if sem is None:
            res = await send(req, t0)
        else:
            async with sem:
                res = await send(req, t0)
        if bar is not None:
            bar.update(1)
        return res

    gaps = arrival_gaps(len(reqs), rate, burstiness, seed)
    tasks = []
    t0 = time.perf_counter()
    for req, gap in zip(reqs, gaps):
        tasks.append(asyncio.create_task(one(req, t0)))
        if gap:
            await asyncio.sleep(gap)
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return results, duration


async def benchmark(args, reqs: list[SampleRequest], rates: list[float], tokenizer) -> tuple[str, list[tuple]]:
    """Warm up with one request, then one pass per rate: (model name, [(rate, results, seconds)])."""
    import httpx

    base_url = args.base_url.rstrip("/")
    url = base_url + (args.endpoint or ENDPOINTS[args.backend])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.backend == "openai-chat":
        reqs = [as_text(r, tokenizer, args.seed) for r in reqs]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30), limits=limits) as client:
        model = args.model
        if not model:
            try:
                model = await first_model(client, base_url, headers)
            except httpx.HTTPError as e:
                raise ValueError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
        first = reqs[0]
        test = SampleRequest(first.prompt, first.prompt_len, min(first.output_len, 4))
        body = request_body(args.backend, test, model, ignore_eos=args.ignore_eos, temperature=args.temperature,
                            extra_body=args.extra_body)
        warm = await send_request(client, url, args.backend, body, headers, test.prompt_len)
        if not warm.ok:
            raise ValueError(f"the test request to {url} failed: {warm.error}")
        passes = []
        for i, rate in enumerate(rates):
            results, duration = await run_pass(
                client, url, args.backend, reqs, model, headers, rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, seed=args.seed + 1 + i, ignore_eos=args.ignore_eos,
                temperature=args.temperature, extra_body=args.extra_body, progress=not args.disable_tqdm)
            passes.append((rate, results, duration))
    return model, passes
