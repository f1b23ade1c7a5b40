"""The ``--surfaces`` workload of benchmarks/soak.py: every surface a user hits, in one soak.

    python benchmarks/soak.py --surfaces all --num-requests 3000 --concurrency 16

The soak starts one server per model the surfaces need, each with the flags that turn its
surfaces on, and builds what they serve at start-up in a temporary directory (tiny random
checkpoints and PEFT adapters made with the tests' helpers, tests/*checkpoints.py and
tests/lora/peft_adapters.py; there is no hub):

- ``gen``: the generating model (the embedded tiny-shakespeare unless --model) with two LoRA
  adapters (``--enable-lora --lora-modules``, ``--allow-runtime-lora-updating``), tools
  (``--enable-auto-tool-choice --tool-call-parser hermes``) and the disk KV offload tier
  (``--kv-offloading-backend disk``: its blocks live in files, so the tier filling up is not
  resident memory the RSS check would hold against the server) under a small KV cache, so that
  long shared prefixes are evicted into the tier and loaded back;
- ``llava``: a tiny random LLaVA (CLIP 16 px, 4 px patches) for images;
- ``embed``: a tiny BERT with sentence-transformers mean pooling (/v1/embeddings, /pooling embed
  and token_embed, /score and /rerank by cosine), ``--max-pooling-tokens`` and
  ``--max-pooling-output-values`` lowered so over-limit requests are cheap to send;
- ``rerank``: a tiny BERT cross-encoder (/score, /rerank, /v2/rerank, /pooling classify).

The workload (``SHARES`` of the requests, the rest soak.py's default mix on ``gen``):
responses (store true / false, GET, input_items, DELETE, previous_response_id follow-ups,
background with polling, cancels and deletes while running, streams, tools, json_schema, and the
4xx cases), tools on chat (auto, required, named, none; streamed; tool results in the history),
structured outputs (guided_json / choice / regex / grammar, response_format json_schema and
json_object; a few distinct per request so the compiler is busy), beam search (completions and
chat, several prompts, token ids; streamed, sampled, constrained or with an adapter: 400), LoRA
(both adapters, streamed, n > 1, a runtime load -> use -> unload flow, guided, long prefixes),
the KV tier (prompts on twelve ~600-token shared
prefixes, chat with them as the system message, cache_salt), images (1-16 small PNGs of varied
sizes and modes, repeated ones, streamed; hostile: 1x100000 and 100000x1, 17 and 64 images, over
the pixel limit and the request's pixel budget, broken base64, not an image, a truncated PNG,
remote and file URLs, a 10 MB body, images to the text-only model, beam search with an image) and
pooling (each route; over-limit: too many inputs, too many tokens, an input over max_model_len,
a reply too large, bad truncation, unsupported dimensions and tasks, the generation routes).

A request that is several calls (a stored response read back and deleted, a background response
polled to its end) is a *flow*: one row of the table, its outcome the statuses of its calls in
order (``200>200x3>404``), judged call by call; a background response that ends ``failed``, or
is ``cancelled`` when nobody cancelled it, or a stream with an ``error`` event or no final
event, counts as a server error.
"""
from __future__ import annotations

import base64
import functools
import io
import json
import os
import random
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "models", "tiny-shakespeare")

SURFACES = ("responses", "tools", "structured", "beam", "lora", "kv_tier", "images", "pooling")
# each surface's share of the soak; what is left is soak.py's default mix (0.40 with all of them)
SHARES = {"responses": 0.10, "tools": 0.06, "structured": 0.07, "beam": 0.04, "lora": 0.06, "kv_tier": 0.06,
          "images": 0.11, "pooling": 0.10}
LORA_NAMES = ("soak-lora", "soak-lora-qv")

WORDS = ("thou thee thy lord king queen night day love death sword crown heaven earth fair foul speak hear "
         "brother sister father mother Rome Verona Padua blood honour grace noble gentle sweet sorrow "
         "tomorrow yesterday fortune fool wise mad stars moon sun time heart soul eyes hand tongue").split()
CHATS = ["Who art thou?", "Tell me of the king.", "What news from Verona?", "hi", "Speak the speech, I pray you."]
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "HAMLET:\nTo be, or not to be", "Speak, friend, and", "the"]


def parse_surfaces(text: str | None) -> tuple[str, ...]:
    """``all``, ``none`` or a comma list of SURFACES (in SURFACES' order)."""
    if text in (None, "", "none"):
        return ()
    if text == "all":
        return SURFACES
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in SURFACES]
    if bad:
        raise ValueError(f"unknown surfaces {bad}; known: {', '.join(SURFACES)} (or all)")
    return tuple(s for s in SURFACES if s in names)


# ---- what the servers serve --------------------------------------------------------------------
def build_assets(workdir: str, gen_model: str, surfaces: tuple[str, ...]) -> dict:
    """The adapters and checkpoints the surfaces need, made under ``workdir`` (run in a child
    process by soak.py: torch, transformers and PEFT stay out of the driver)."""
    tests = os.path.join(REPO, "tests")
    sys.path[:0] = [tests, os.path.join(tests, "lora")]
    out: dict = {}
    if "lora" in surfaces:
        from peft_adapters import make_adapter

        out["lora"] = {LORA_NAMES[0]: make_adapter(gen_model, os.path.join(workdir, "lora"), r=8, seed=11),
                       LORA_NAMES[1]: make_adapter(gen_model, os.path.join(workdir, "lora-qv"), r=4,
                                                   targets=("q_proj", "v_proj"), seed=12)}
    if "kv_tier" in surfaces:
        out["kv_dir"] = os.path.join(workdir, "kv-tier")
        os.makedirs(out["kv_dir"], exist_ok=True)
    if "images" in surfaces:
        from llava_checkpoints import make_llava_checkpoint

        out["llava"] = make_llava_checkpoint(os.path.join(workdir, "llava"))
    if "pooling" in surfaces:
        from pooling_checkpoints import make_pooling_checkpoint

        out["embed"] = make_pooling_checkpoint(os.path.join(workdir, "embed"), "bert_mean")
        out["rerank"] = make_pooling_checkpoint(os.path.join(workdir, "rerank"), "bert_rerank")
    return out


def server_plans(surfaces: tuple[str, ...], assets: dict) -> dict[str, dict]:
    """name -> {"model", "name" (served), "flags"} of each server; ``gen`` always (its flags go
    before soak.py's ``--`` extras, which may override them)."""
    gen = ["--kv-cache-memory", "24MiB"]
    if "lora" in surfaces:
        gen += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--allow-runtime-lora-updating",
                "--lora-modules", *(f"{k}={v}" for k, v in assets["lora"].items())]
    if "tools" in surfaces or "responses" in surfaces:
        gen += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    if "kv_tier" in surfaces:
        gen += ["--kv-offloading-backend", "disk", "--kv-offload-dir", assets["kv_dir"], "--kv-offloading-size", "0.25"]
    plans = {"gen": {"model": None, "name": "tiny-shakespeare", "flags": gen}}
    aux = ["--cpu-threads", "1"]
    if "images" in surfaces:
        plans["llava"] = {"model": assets["llava"], "name": "llava",
                          "flags": aux + ["--kv-cache-memory", "16MiB", "--max-model-len", "512"]}
    if "pooling" in surfaces:
        limits = ["--max-pooling-tokens", "8192", "--max-pooling-output-values", "65536"]
        plans["embed"] = {"model": assets["embed"], "name": "embed", "flags": aux + ["--runner", "pooling"] + limits}
        plans["rerank"] = {"model": assets["rerank"], "name": "rerank", "flags": aux + ["--runner", "pooling"] + limits}
    return plans


# ---- images ----------------------------------------------------------------------------------------
def _png(img, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **options)
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@functools.lru_cache(maxsize=None)
def image_pool(seed: int = 0) -> tuple[str, ...]:
    """Small PNGs of varied sizes and modes as data: URLs: noise up to 256x256, smooth gradients
    up to 1024x768 (a few KB), RGB / RGBA / L / P."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for w, h in [(1, 1), (4, 4), (16, 16), (20, 30), (33, 17), (64, 48), (100, 100), (7, 300), (300, 7), (256, 256)]:
        for mode in ("RGB", "RGBA", "L"):
            c = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
            a = rng.integers(0, 256, (h, w, c), dtype=np.uint8)
            out.append(_url(_png(Image.fromarray(a[..., 0] if c == 1 else a, mode))))
    for w, h in [(640, 480), (1024, 768), (333, 999)]:
        x = np.linspace(0, 255, w, dtype=np.float32)[None, :] + np.linspace(0, 255, h, dtype=np.float32)[:, None]
        out.append(_url(_png(Image.fromarray(np.stack([x / 2, 255 - x / 2, x / 3], -1).astype(np.uint8), "RGB"))))
    pal = Image.fromarray(rng.integers(0, 4, (40, 60), dtype=np.uint8), "P")
    pal.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    out.append(_url(_png(pal, transparency=0)))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def hostile_images() -> dict[str, str]:
    """data: URLs a hostile client sends (each a few KB at most)."""
    from PIL import Image

    def palette(w, h):
        img = Image.new("P", (w, h))
        img.putpalette([0, 0, 0, 255, 255, 255])
        return _png(img, transparency=0)

    small = _png(Image.new("RGB", (20, 20), (9, 99, 199)))
    return {
        "tall_1x100000": _url(_png(Image.new("L", (1, 100000), 128))),
        "wide_100000x1": _url(_png(Image.new("RGB", (100000, 1), (7, 200, 90)))),
        "over_pixel_limit_6000x6000": _url(palette(6000, 6000)),
        "budget_4000x4000": _url(palette(4000, 4000)),  # five of them pass the request's pixel budget
        "truncated_png": _url(small[:small.index(b"IDAT") + 8]),
        "not_an_image": _url(b"GIF89a? no, just bytes" * 10),
        "broken_base64": "data:image/png;base64,iVBORw0KGgo@@@@!!",
        "remote_url": "https://example.com/cat.png",
        "file_url": "file:///etc/hostname",
        "empty_data_url": "data:,",
    }


# ---- flows: requests of several calls ------------------------------------------------------------
class FlowState:
    """The calls of one flow: (name, status, expected classes) each; ``error`` a server-side
    failure seen in an answer's body (a failed background response, a stream's error event)."""

    def __init__(self, client, base: str, headers: dict) -> None:
        self.client, self.base, self.headers = client, base, headers
        self.steps: list[tuple[str, int | None, tuple]] = []
        self.error: str | None = None
        self.aborted = False

    async def call(self, name: str, method: str, path: str, body=None, expect=("2xx",)):
        headers = dict(self.headers)
        content = None
        if body is not None:
            content = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        r = await self.client.request(method, self.base + path, content=content, headers=headers)
        self.steps.append((name, r.status_code, expect))
        return r

    def fail(self, what: str) -> None:
        self.error = self.error or what


def outcome_of(steps) -> str:
    """``200>200x3>404``: the calls' statuses in order, runs collapsed."""
    out: list[list] = []
    for _, status, _ in steps:
        if out and out[-1][0] == status:
            out[-1][1] += 1
        else:
            out.append([status, 1])
    return ">".join(f"{s}" + (f"x{n}" if n > 1 else "") for s, n in out) or "-"


def _json(r) -> dict:
    try:
        return r.json()
    except ValueError:
        return {}


TERMINAL = ("completed", "incomplete", "failed", "cancelled")


async def _poll(st: FlowState, rid: str, interval: float) -> str | None:
    import asyncio

    while True:
        r = await st.call("poll", "GET", f"/v1/responses/{rid}")
        if r.status_code != 200:
            return None
        status = _json(r).get("status")
        if status in TERMINAL:
            return status
        await asyncio.sleep(interval)


def _check_done(st: FlowState, status: str | None, cancelled: bool = False) -> None:
    if status == "failed" or (status == "cancelled" and not cancelled):
        st.fail(f"background_{status}")


async def flow_store(st: FlowState, body: dict) -> None:
    """create (stored) -> GET -> input_items -> DELETE -> GET 404."""
    r = await st.call("create", "POST", "/v1/responses", body)
    rid = _json(r).get("id")
    if r.status_code != 200 or not rid:
        return
    await st.call("get", "GET", f"/v1/responses/{rid}")
    await st.call("input_items", "GET", f"/v1/responses/{rid}/input_items")
    await st.call("delete", "DELETE", f"/v1/responses/{rid}")
    await st.call("get_deleted", "GET", f"/v1/responses/{rid}", expect=("404",))


async def flow_not_stored(st: FlowState, body: dict) -> None:
    """create with store false -> GET 404 -> follow-up 404."""
    r = await st.call("create", "POST", "/v1/responses", {**body, "store": False})
    rid = _json(r).get("id")
    if r.status_code != 200 or not rid:
        return
    await st.call("get", "GET", f"/v1/responses/{rid}", expect=("404",))
    await st.call("follow_up", "POST", "/v1/responses", {"input": "and then?", "max_output_tokens": 4,
                                                          "previous_response_id": rid}, expect=("404",))


async def flow_follow_up(st: FlowState, body: dict, turns: int) -> None:
    """create -> ``turns`` follow-ups on previous_response_id -> DELETE each -> a follow-up of a
    deleted one 404."""
    ids = []
    for k in range(turns + 1):
        b = dict(body) if k == 0 else {"input": CHATS[k % len(CHATS)], "max_output_tokens": body.get(
            "max_output_tokens", 8), "previous_response_id": ids[-1]}
        r = await st.call("create" if k == 0 else "follow_up", "POST", "/v1/responses", b)
        rid = _json(r).get("id")
        if r.status_code != 200 or not rid:
            return
        ids.append(rid)
    for rid in ids:
        await st.call("delete", "DELETE", f"/v1/responses/{rid}")
    await st.call("follow_deleted", "POST", "/v1/responses", {"input": "x", "max_output_tokens": 2,
                                                               "previous_response_id": ids[-1]}, expect=("404",))


async def flow_background(st: FlowState, body: dict, interval: float, delete: bool) -> None:
    """create background -> poll until it ends (completed / incomplete) -> DELETE (or leave it
    to the store's bound)."""
    r = await st.call("create", "POST", "/v1/responses", {**body, "background": True})
    rid = _json(r).get("id")
    if r.status_code != 200 or not rid:
        return
    _check_done(st, await _poll(st, rid, interval))
    if delete:
        await st.call("delete", "DELETE", f"/v1/responses/{rid}")


async def flow_background_cancel(st: FlowState, body: dict, wait: float, delete: bool) -> None:
    """create background -> wait -> cancel -> GET: cancelled (or finished before the cancel)."""
    import asyncio

    r = await st.call("create", "POST", "/v1/responses", {**body, "background": True})
    rid = _json(r).get("id")
    if r.status_code != 200 or not rid:
        return
    await asyncio.sleep(wait)
    r = await st.call("cancel", "POST", f"/v1/responses/{rid}/cancel")
    status = _json(r).get("status")
    if r.status_code == 200 and status not in TERMINAL:
        st.fail(f"cancel_left_{status}")
    r = await st.call("get", "GET", f"/v1/responses/{rid}")
    _check_done(st, _json(r).get("status"), cancelled=True)
    if delete:
        await st.call("delete", "DELETE", f"/v1/responses/{rid}")


async def flow_background_delete(st: FlowState, body: dict) -> None:
    """create background -> DELETE while it runs -> GET 404 -> cancel 404."""
    r = await st.call("create", "POST", "/v1/responses", {**body, "background": True})
    rid = _json(r).get("id")
    if r.status_code != 200 or not rid:
        return
    await st.call("delete", "DELETE", f"/v1/responses/{rid}")
    await st.call("get", "GET", f"/v1/responses/{rid}", expect=("404",))
    await st.call("cancel", "POST", f"/v1/responses/{rid}/cancel", expect=("404",))


async def flow_cancel_foreground(st: FlowState, body: dict) -> None:
    """create (not background) -> cancel 400 -> DELETE."""
    r = await st.call("create", "POST", "/v1/responses", body)
    rid = _json(r).get("id")
    if r.status_code != 200 or not rid:
        return
    await st.call("cancel", "POST", f"/v1/responses/{rid}/cancel", expect=("400",))
    await st.call("delete", "DELETE", f"/v1/responses/{rid}")


async def flow_stream(st: FlowState, body: dict, abort_after: int | None) -> None:
    """A streamed response: an ``error`` / ``response.failed`` event, or no final event, is a
    server error; ``abort_after`` events read, the client disconnects."""
    headers = {**st.headers, "content-type": "application/json"}
    req = st.client.build_request("POST", st.base + "/v1/responses", headers=headers,
                                  content=json.dumps({**body, "stream": True}).encode())
    resp = await st.client.send(req, stream=True)
    try:
        st.steps.append(("stream", resp.status_code, ("2xx",)))
        if resp.status_code != 200:
            await resp.aread()
            return
        events, final = 0, None
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            kind = json.loads(line[6:]).get("type", "")
            if kind in ("error", "response.failed"):
                st.fail("stream_" + kind)
            if kind in ("response.completed", "response.incomplete", "response.failed"):
                final = kind
            if abort_after is not None and events >= abort_after:
                st.aborted = True
                return
        if final is None:
            st.fail("stream_without_final_event")
    finally:
        await resp.aclose()


async def flow_tool_result(st: FlowState, body: dict) -> None:
    """create with tools -> when it called one, send the result back (function_call_output) on
    previous_response_id -> DELETE both."""
    r = await st.call("create", "POST", "/v1/responses", body)
    out = _json(r)
    rid = out.get("id")
    if r.status_code != 200 or not rid:
        return
    ids = [rid]
    calls = [o for o in out.get("output", []) if o.get("type") == "function_call"]
    if calls:
        r = await st.call("tool_result", "POST", "/v1/responses", {
            "previous_response_id": rid, "max_output_tokens": 8, "tools": body["tools"],
            "input": [{"type": "function_call_output", "call_id": c["call_id"], "output": "42"} for c in calls]})
        if r.status_code == 200 and _json(r).get("id"):
            ids.append(_json(r)["id"])
    for i in ids:
        await st.call("delete", "DELETE", f"/v1/responses/{i}")


async def flow_runtime_lora(st: FlowState, name: str, path: str) -> None:
    """load an adapter at run time -> a completion with it -> unload -> the name 404s."""
    r = await st.call("load", "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    if r.status_code != 200:
        return
    await st.call("use", "POST", "/v1/completions", {"model": name, "prompt": "ROMEO:", "max_tokens": 4})
    await st.call("model_card", "GET", f"/v1/models/{name}")
    await st.call("unload", "POST", "/v1/unload_lora_adapter", {"lora_name": name})
    await st.call("use_unloaded", "POST", "/v1/completions", {"model": name, "prompt": "a", "max_tokens": 1},
                  expect=("404",))


# ---- the workload ----------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "send_letter", "parameters": {
        "type": "object", "properties": {"to": {"type": "string", "enum": ["Romeo", "Juliet", "Tybalt"]},
                                         "urgent": {"type": "boolean"}}, "required": ["to"]}}},
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "alive": {"type": "boolean"}}, "required": ["age", "alive"]},
    {"type": "array", "items": {"type": "string", "enum": ["rose", "thorn", "bud"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Verona", "Mantua", "Padua"]},
                                      "day": {"type": "integer", "minimum": 1, "maximum": 31}}, "required": ["city"]},
]
CHOICES = [["yes", "no"], ["Verona", "Mantua", "Padua"], ["Montague", "Capulet"], ["to be", "not to be"]]
REGEXES = [r"[A-Z][a-z]{2,8}", r"[0-9]{1,3}-[0-9]{1,3}", r"(thou|thee|thy) [a-z]{3,6}", r"[a-z]+@[a-z]+\.com"]
GRAMMARS = ['root ::= "yes" | "no" | "perhaps"', 'root ::= word (" " word){0,3}\nword ::= [a-z]{1,6}']


class Context:
    """What the surface generators draw from (built once)."""

    def __init__(self, seed: int, surfaces: tuple[str, ...], assets: dict) -> None:
        rng = random.Random(seed + 7)
        self.surfaces, self.assets = surfaces, assets
        # twelve shared prefixes of about 600 tokens each: more than the 24 MiB KV cache (4096
        # tokens) holds, so the colder ones are evicted into the tier and loaded back
        self.prefixes = [f"PROLOGUE {k}:\n" + " ".join(rng.choice(WORDS) for _ in range(450)) for k in range(12)]
        self.images = image_pool(seed) if "images" in surfaces else ()
        self.hostile_images = hostile_images() if "images" in surfaces else {}
        self.lora_path = assets.get("lora", {}).get(LORA_NAMES[1])
        self._body_10mb = None

    def body_10mb(self) -> bytes:
        """One image chat body of 10 MB (a data: URL past the server's body limit), shared."""
        if self._body_10mb is None:
            self._body_10mb = _body(_image_chat(self, ["data:image/png;base64," + "A" * (10 << 20)], max_tokens=2))
        return self._body_10mb


def _pick(rng: random.Random, table):
    names, weights = zip(*table)
    return rng.choices(names, weights)[0]


def _max(rng, lo=2, hi=16) -> int:
    return rng.randint(lo, hi)


def responses_spec(rng: random.Random, i: int, ctx: Context, Spec):
    base = {"input": rng.choice(CHATS), "max_output_tokens": _max(rng, 4, 24), "temperature": rng.choice([0, 0.8])}
    if rng.random() < 0.3:
        base["instructions"] = "Answer as a Shakespearean king."
    if rng.random() < 0.1:
        base["input"] = [{"role": "user", "content": [{"type": "input_text", "text": rng.choice(CHATS)}]}]
    kind = _pick(rng, [("store_get_delete", 14), ("not_stored", 8), ("follow_up", 12), ("background_poll", 14),
                       ("background_cancel", 10), ("background_delete_running", 5), ("stream", 12),
                       ("stream_abort", 4), ("tools", 8), ("json_schema", 5), ("cancel_foreground", 3),
                       ("bad_previous_id", 2), ("bad_background_stream", 1), ("bad_background_not_stored", 1),
                       ("bad_get_unknown", 1), ("bad_image_input", 1), ("bad_web_search_tool", 1),
                       ("bad_overlong_input", 1), ("bad_negative_max_output_tokens", 1)])
    flow = None
    if kind == "store_get_delete":
        flow = functools.partial(flow_store, body=base)
    elif kind == "not_stored":
        flow = functools.partial(flow_not_stored, body=base)
    elif kind == "follow_up":
        flow = functools.partial(flow_follow_up, body=base, turns=rng.randint(1, 3))
    elif kind == "background_poll":
        flow = functools.partial(flow_background, body=base, interval=rng.uniform(0.02, 0.2),
                                 delete=rng.random() < 0.7)
    elif kind == "background_cancel":
        flow = functools.partial(flow_background_cancel, body={**base, "max_output_tokens": _max(rng, 64, 256)},
                                 wait=rng.uniform(0, 0.3), delete=rng.random() < 0.5)
    elif kind == "background_delete_running":
        flow = functools.partial(flow_background_delete, body={**base, "max_output_tokens": 200})
    elif kind in ("stream", "stream_abort"):
        flow = functools.partial(flow_stream, body=base, abort_after=rng.randint(2, 5) if kind == "stream_abort"
                                 else None)
    elif kind == "tools":
        choice = rng.choice(["auto", "required", {"type": "function", "name": rng.choice(RESPONSES_TOOLS)["name"]}])
        flow = functools.partial(flow_tool_result, body={**base, "tools": RESPONSES_TOOLS, "tool_choice": choice,
                                                          "max_output_tokens": _max(rng, 24, 48)})
    elif kind == "json_schema":
        flow = functools.partial(flow_store, body={**base, "max_output_tokens": 40, "text": {"format": {
            "type": "json_schema", "name": "answer", "schema": rng.choice(SCHEMAS), "strict": True}}})
    elif kind == "cancel_foreground":
        flow = functools.partial(flow_cancel_foreground, body=base)
    if flow is not None:
        return Spec(f"responses/{kind}", path="/v1/responses", flow=flow, expect=("2xx",))
    bad = {"bad_previous_id": ({**base, "previous_response_id": f"resp_{i:032x}"}, ("404",)),
           "bad_background_stream": ({**base, "background": True, "stream": True}, ("400",)),
           "bad_background_not_stored": ({**base, "background": True, "store": False}, ("400",)),
           "bad_image_input": ({**base, "input": [{"role": "user", "content": [
               {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, ("400",)),
           "bad_web_search_tool": ({**base, "tools": [{"type": "web_search"}]}, ("400",)),
           "bad_overlong_input": ({**base, "input": "w " * 200000}, ("400",)),
           "bad_negative_max_output_tokens": ({**base, "max_output_tokens": -3}, ("400",))}
    if kind == "bad_get_unknown":
        return Spec("responses/bad_get_unknown", method="GET", path=f"/v1/responses/resp_{i:032x}", expect=("404",))
    body, expect = bad[kind]
    return Spec(f"responses/{kind}", path="/v1/responses", body=_body(body), expect=expect)


def _body(obj) -> bytes:
    return json.dumps(obj).encode()


def _messages(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": rng.choice(CHATS)}]


def tools_spec(rng: random.Random, i: int, ctx: Context, Spec):
    choice = _pick(rng, [("auto", 35), ("required", 30), ("named", 25), ("none", 10), ("bad_named_unknown", 1),
                         ("bad_required_without_tools", 1), ("bad_parameters_not_a_schema", 1)])
    if choice.startswith("bad_"):
        body = {"messages": _messages(rng), "max_tokens": 8, "tools": TOOLS, "tool_choice": "required"}
        if choice == "bad_named_unknown":
            body["tool_choice"] = {"type": "function", "function": {"name": "no_such_function"}}
        elif choice == "bad_required_without_tools":
            del body["tools"]
        else:
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
        return Spec(f"tools/{choice}", path="/v1/chat/completions", body=_body(body), expect=("4xx",))
    body = {"messages": _messages(rng), "tools": rng.sample(TOOLS, rng.randint(1, 3)), "max_tokens": _max(rng, 16, 48),
            "temperature": rng.choice([0, 0.8])}
    if choice == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": rng.choice(body["tools"])["function"]["name"]}}
    else:
        body["tool_choice"] = choice
    if choice == "required" and rng.random() < 0.3:
        body["parallel_tool_calls"] = False
    if rng.random() < 0.2:  # an earlier call and its result in the history
        body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}, {"role": "user", "content": "And now?"}]
    stream = rng.random() < 0.4
    abort = None
    if stream:
        body["stream"] = True
        if rng.random() < 0.2:
            abort = ("mid_stream", rng.randint(1, 3))
    kind = f"tools/{choice}{'_stream' if stream else ''}{'_abort' if abort else ''}"
    return Spec(kind, path="/v1/chat/completions", body=_body(body), stream=stream, abort=abort,
                expect=("2xx", "4xx") if abort else ("2xx",))


def structured_spec(rng: random.Random, i: int, ctx: Context, Spec):
    which = _pick(rng, [("guided_json", 20), ("guided_choice", 15), ("guided_regex", 15), ("guided_grammar", 8),
                        ("json_schema", 15), ("json_object", 7), ("regex_distinct", 8), ("choice_distinct", 4),
                        ("so_bad_schema", 2), ("so_two_constraints", 2), ("so_bad_regex", 2), ("so_bad_grammar", 2)])
    chat = rng.random() < 0.5
    body: dict = ({"messages": _messages(rng)} if chat else {"prompt": rng.choice(PROMPTS)})
    body.update(max_tokens=_max(rng, 16, 48), temperature=rng.choice([0, 0.8, 1.0]))
    expect = ("2xx", "429")  # 429: the compile queue is full (not now, retry)
    if which == "guided_json":
        body["guided_json"] = rng.choice(SCHEMAS)
    elif which == "guided_choice":
        body["guided_choice"] = rng.choice(CHOICES)
    elif which == "guided_regex":
        body["guided_regex"] = rng.choice(REGEXES)
    elif which == "guided_grammar":
        body["guided_grammar"] = rng.choice(GRAMMARS)
    elif which == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": rng.choice(SCHEMAS),
                                                                          "strict": True}}
    elif which == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif which == "regex_distinct":  # a new compile every time
        body["guided_regex"] = f"(act{i}|scene{i % 97})-[a-z]{{1,4}}"
        expect = ("2xx", "408", "429")
    elif which == "choice_distinct":
        body["guided_choice"] = [f"{w}{i}" for w in rng.sample(WORDS, 4)]
        expect = ("2xx", "408", "429")
    elif which == "so_bad_schema":
        body["guided_json"] = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
        expect = ("4xx",)
    elif which == "so_two_constraints":
        body.update(guided_choice=["a"], guided_regex="b")
        expect = ("4xx",)
    elif which == "so_bad_regex":
        body["guided_regex"] = "(unclosed[a-"
        expect = ("4xx",)
    elif which == "so_bad_grammar":
        body["guided_grammar"] = "root ::= undefined_rule"
        expect = ("4xx",)
    if rng.random() < 0.1 and expect[0] == "2xx":
        body["n"] = 2
    stream = rng.random() < 0.3 and expect[0] == "2xx"
    if stream:
        body["stream"] = True
    kind = f"structured/{which}_{'chat' if chat else 'completion'}{'_stream' if stream else ''}"
    return Spec(kind, path="/v1/chat/completions" if chat else "/v1/completions", body=_body(body), stream=stream,
                expect=expect)


def beam_spec(rng: random.Random, i: int, ctx: Context, Spec):
    which = _pick(rng, [("completion", 45), ("chat", 30), ("prompts", 12), ("token_ids", 6), ("bad_stream", 2),
                        ("bad_temperature", 2), ("bad_guided", 1), ("bad_lora", 2 if "lora" in ctx.surfaces else 0)])
    body: dict = {"use_beam_search": True, "n": rng.randint(2, 4), "max_tokens": _max(rng, 4, 16), "temperature": 0}
    if rng.random() < 0.5:
        body["length_penalty"] = round(rng.uniform(0.5, 1.5), 2)
    if rng.random() < 0.3:
        body["early_stopping"] = rng.choice([True, False, "never"])
    path, expect = "/v1/completions", ("2xx",)
    if which == "chat":
        path, body["messages"] = "/v1/chat/completions", _messages(rng)
    elif which == "prompts":
        body["prompt"] = rng.sample(PROMPTS, rng.randint(2, 3))
    elif which == "token_ids":
        body["prompt"] = [rng.randrange(3, 2000) for _ in range(rng.randint(2, 40))]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    if which == "bad_lora":  # beam search with an adapter is refused (engine/input_processor.py)
        body["model"], expect = rng.choice(LORA_NAMES), ("400",)
    elif which == "bad_stream":
        body["stream"], expect = True, ("400",)
    elif which == "bad_temperature":
        body["temperature"], expect = 0.7, ("400",)
    elif which == "bad_guided":
        body["guided_choice"], expect = ["a", "b"], ("400",)
    return Spec(f"beam/{which}", path=path, body=_body(body), expect=expect)


def lora_spec(rng: random.Random, i: int, ctx: Context, Spec):
    which = _pick(rng, [("completion", 25), ("completion_stream", 15), ("chat", 15), ("chat_stream", 10),
                        ("model_card", 5), ("runtime_load_use_unload", 8), ("long_prefix", 8), ("guided", 6),
                        ("abort_stream", 5), ("n2", 3), ("bad_load_served_name", 1), ("bad_load_missing_path", 1),
                        ("bad_unload_unknown", 1)])
    model = rng.choice(LORA_NAMES)
    if which == "bad_load_served_name":  # a name in use (an adapter of --lora-modules)
        return Spec("lora/bad_load_served_name", path="/v1/load_lora_adapter", expect=("4xx",),
                    body=_body({"lora_name": model, "lora_path": ctx.lora_path}))
    if which == "bad_load_missing_path":
        return Spec("lora/bad_load_missing_path", path="/v1/load_lora_adapter", expect=("4xx",),
                    body=_body({"lora_name": f"soak-missing-{i}", "lora_path": f"/nonexistent/adapter-{i}"}))
    if which == "bad_unload_unknown":
        return Spec("lora/bad_unload_unknown", path="/v1/unload_lora_adapter", expect=("4xx",),
                    body=_body({"lora_name": f"soak-never-loaded-{i}"}))
    if which == "model_card":
        return Spec("lora/model_card", method="GET", path=f"/v1/models/{model}")
    if which == "runtime_load_use_unload":
        return Spec("lora/runtime_load_use_unload", flow=functools.partial(
            flow_runtime_lora, name=f"soak-rt-{i}", path=ctx.lora_path))
    chat = which.startswith("chat") or rng.random() < 0.2
    body: dict = {"model": model, "max_tokens": _max(rng, 2, 24), "temperature": rng.choice([0, 0.8])}
    if chat:
        body["messages"] = _messages(rng)
    else:
        body["prompt"] = rng.choice(PROMPTS)
    if which == "long_prefix":
        if chat:
            body["messages"] = [{"role": "system", "content": rng.choice(ctx.prefixes)}] + body["messages"]
        else:
            body["prompt"] = rng.choice(ctx.prefixes) + "\n" + rng.choice(PROMPTS)
    elif which == "guided":
        body["guided_choice"] = rng.choice(CHOICES)
    elif which == "n2":
        body["n"] = 2
    stream = which.endswith("stream")
    abort = ("mid_stream", rng.randint(1, 3)) if which == "abort_stream" else None
    if stream:
        body["stream"] = True
    return Spec(f"lora/{which}", path="/v1/chat/completions" if chat else "/v1/completions", body=_body(body),
                stream=stream, abort=abort, expect=("2xx", "4xx") if abort else ("2xx",))


def kv_tier_spec(rng: random.Random, i: int, ctx: Context, Spec):
    which = _pick(rng, [("completion", 45), ("completion_stream", 15), ("chat_system", 25), ("cache_salt", 8),
                        ("abort", 7), ("bad_over_max_model_len", 1)])
    prefix = ctx.prefixes[min(int(rng.expovariate(0.35)), len(ctx.prefixes) - 1)]  # some prefixes hotter
    body: dict = {"max_tokens": _max(rng, 2, 12), "temperature": rng.choice([0, 0.8])}
    chat = which == "chat_system"
    if chat:
        body["messages"] = [{"role": "system", "content": prefix}, {"role": "user", "content": rng.choice(CHATS)}]
    else:
        body["prompt"] = prefix + "\n" + rng.choice(PROMPTS)
    if which == "cache_salt":
        body["cache_salt"] = f"tenant-{rng.randrange(3)}"
    if which == "bad_over_max_model_len":  # two prefixes: past max_model_len (1024)
        body["prompt"] = prefix + "\n" + ctx.prefixes[-1]
        return Spec(f"kv_tier/{which}", body=_body(body), expect=("400",))
    stream = which in ("completion_stream", "abort") and rng.random() < 0.7
    abort = None
    if which == "abort":
        body["max_tokens"] = 64
        abort = ("mid_stream", rng.randint(1, 3)) if stream else ("before_answer", rng.uniform(0.01, 0.2))
    if stream:
        body["stream"] = True
    return Spec(f"kv_tier/{which}", path="/v1/chat/completions" if chat else "/v1/completions", body=_body(body),
                stream=stream, abort=abort, expect=("2xx", "4xx") if abort else ("2xx",))


def _image_chat(ctx: Context, urls: list[str], text: str = "w1 w2 w3", **extra) -> dict:
    content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "llava", "messages": [{"role": "user", "content": content}], **extra}


def images_spec(rng: random.Random, i: int, ctx: Context, Spec):
    which = _pick(rng, [("one", 30), ("few", 20), ("sixteen", 3), ("repeat_same", 10), ("stream", 10),
                        ("two_turns", 5), ("guided", 3), ("abort", 4),
                        ("hostile_tall_1x100000", 2), ("hostile_wide_100000x1", 2), ("bad_17_images", 1),
                        ("bad_64_images", 1), ("bad_over_pixel_limit", 1), ("bad_pixel_budget", 1),
                        ("bad_broken_base64", 1), ("bad_not_an_image", 1), ("bad_truncated_png", 1),
                        ("bad_remote_url", 1), ("bad_file_url", 1), ("bad_empty_data_url", 1),
                        ("bad_body_10mb", 1), ("bad_beam_with_image", 1), ("bad_mm_processor_kwargs", 1),
                        ("bad_to_text_model", 1), ("bad_missing_url", 1)])
    pool, hostile = ctx.images, ctx.hostile_images
    sampling = {"max_tokens": _max(rng, 2, 12), "temperature": rng.choice([0, 0.8])}
    server, expect, stream, abort = "llava", ("4xx",), False, None
    if which == "one":
        body, expect = _image_chat(ctx, [rng.choice(pool)], **sampling), ("2xx",)
    elif which == "few":
        body, expect = _image_chat(ctx, rng.sample(pool, rng.randint(2, 5)), **sampling), ("2xx",)
    elif which == "sixteen":
        body, expect = _image_chat(ctx, [rng.choice(pool[:12]) for _ in range(16)], **sampling), ("2xx",)
    elif which == "repeat_same":  # the same image again: its blocks hit the prefix cache
        body, expect = _image_chat(ctx, [pool[i % 3]], text="w5 w6", **sampling), ("2xx",)
    elif which in ("stream", "abort"):
        if which == "abort":
            sampling["max_tokens"] = 48
        body = _image_chat(ctx, rng.sample(pool, rng.randint(1, 3)), stream=True, **sampling)
        stream, expect = True, ("2xx",)
        if which == "abort":
            abort, expect = ("mid_stream", rng.randint(1, 3)), ("2xx", "4xx")
    elif which == "two_turns":
        body = _image_chat(ctx, [rng.choice(pool)], **sampling)
        body["messages"] += [{"role": "assistant", "content": "w9 w10"},
                             {"role": "user", "content": [{"type": "image_url", "image_url": {"url": rng.choice(pool)}},
                                                          {"type": "text", "text": "w11"}]}]
        expect = ("2xx",)
    elif which == "guided":
        body = _image_chat(ctx, [rng.choice(pool)], guided_choice=["w1", "w2", "w3"], **sampling)
        expect = ("2xx", "429")
    elif which in ("hostile_tall_1x100000", "hostile_wide_100000x1"):
        body, expect = _image_chat(ctx, [hostile[which[len("hostile_"):]]], **sampling), ("2xx", "4xx")
    elif which == "bad_17_images":
        body = _image_chat(ctx, [rng.choice(pool[:12]) for _ in range(17)], **sampling)
    elif which == "bad_64_images":
        body = _image_chat(ctx, [pool[0]] * 64, **sampling)
    elif which == "bad_over_pixel_limit":
        body = _image_chat(ctx, [hostile["over_pixel_limit_6000x6000"]], **sampling)
    elif which == "bad_pixel_budget":
        body = _image_chat(ctx, [hostile["budget_4000x4000"]] * 5, **sampling)
    elif which == "bad_body_10mb":  # 413, or the connection closed while the body is still uploading
        return Spec(f"images/{which}", path="/v1/chat/completions", body=ctx.body_10mb(), expect=("4xx", "closed"),
                    server=server)
    elif which == "bad_beam_with_image":
        body = _image_chat(ctx, [rng.choice(pool)], use_beam_search=True, n=2, temperature=0, max_tokens=4)
    elif which == "bad_mm_processor_kwargs":
        body = _image_chat(ctx, [rng.choice(pool)], mm_processor_kwargs={"do_resize": False}, **sampling)
    elif which == "bad_to_text_model":
        body, server = _image_chat(ctx, [rng.choice(pool)], **sampling), "gen"
        del body["model"]
    elif which == "bad_missing_url":
        body = _image_chat(ctx, [], **sampling)
        body["messages"][0]["content"].append({"type": "image_url", "image_url": {}})
    else:  # bad_<hostile image name>
        body = _image_chat(ctx, [hostile[which[len("bad_"):]]], **sampling)
    return Spec(f"images/{which}", path="/v1/chat/completions", body=_body(body), stream=stream, abort=abort,
                expect=expect, server=server)


def _text(rng: random.Random, lo=1, hi=12) -> str:
    return " ".join(f"w{rng.randrange(5, 195)}" for _ in range(rng.randint(lo, hi)))


def pooling_spec(rng: random.Random, i: int, ctx: Context, Spec):
    if rng.random() < 0.6:
        which = _pick(rng, [("embeddings", 25), ("embeddings_batch", 15), ("embeddings_token_ids", 6),
                            ("embeddings_base64", 6), ("embeddings_dimensions", 5), ("embeddings_truncate", 4),
                            ("pooling_embed", 6), ("pooling_token_embed", 6), ("score_cosine", 6),
                            ("rerank_cosine", 6), ("tokenize", 3), ("abort_batch", 2),
                            ("bad_too_many_inputs", 1), ("bad_over_max_model_len", 1), ("bad_too_many_tokens", 1),
                            ("bad_reply_too_large", 1), ("bad_truncate_zero", 1), ("bad_dimensions", 1),
                            ("bad_classify_task", 1), ("bad_classify_route", 1), ("bad_generation_route", 1),
                            ("bad_empty_input", 1), ("bad_token_out_of_vocab", 1), ("bad_json", 1)])
        server = "embed"
    else:
        which = _pick(rng, [("score", 25), ("score_many", 10), ("rerank", 20), ("rerank_top_n", 10),
                            ("v2_rerank", 10), ("pooling_classify", 15), ("rerank_truncate", 4),
                            ("bad_too_many_documents", 1), ("bad_embeddings_route", 1), ("bad_pair_too_long", 1),
                            ("bad_empty_text", 1)])
        server = "rerank"
    expect, path, abort = ("2xx",), "/v1/embeddings", None
    if which == "embeddings":
        body = {"input": _text(rng)}
    elif which == "embeddings_batch":
        body = {"input": [_text(rng) for _ in range(rng.randint(2, 32))]}
    elif which == "embeddings_token_ids":
        body = {"input": [[rng.randrange(5, 195) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(1, 4))]}
    elif which == "embeddings_base64":
        body = {"input": [_text(rng) for _ in range(3)], "encoding_format": "base64"}
    elif which == "embeddings_dimensions":
        body = {"input": _text(rng), "dimensions": rng.choice([8, 16, 32, 64])}
    elif which == "embeddings_truncate":
        body = {"input": _text(rng, 50, 200), "truncate_prompt_tokens": rng.choice([-1, 16, 100])}
    elif which == "pooling_embed":
        path, body = "/pooling", {"input": [_text(rng) for _ in range(rng.randint(1, 4))], "task": "embed"}
    elif which == "pooling_token_embed":
        path, body = "/pooling", {"input": _text(rng), "task": "token_embed"}
    elif which in ("score_cosine", "score"):
        path, body = "/score", {"text_1": _text(rng), "text_2": _text(rng)}
    elif which == "score_many":
        path, body = "/score", {"text_1": _text(rng), "text_2": [_text(rng) for _ in range(rng.randint(2, 40))]}
    elif which in ("rerank_cosine", "rerank", "rerank_top_n", "rerank_truncate"):
        path = rng.choice(["/rerank", "/v1/rerank"])
        body = {"query": _text(rng), "documents": [_text(rng, 1, 30) for _ in range(rng.randint(1, 12))]}
        if which == "rerank_top_n":
            body.update(top_n=rng.randint(0, 5), return_documents=rng.random() < 0.5)
        if which == "rerank_truncate":
            body["documents"].append(_text(rng, 150, 200))
            body["truncate_prompt_tokens"] = 64
    elif which == "v2_rerank":
        path, body = "/v2/rerank", {"query": _text(rng), "documents": [_text(rng) for _ in range(4)], "top_n": 2}
    elif which == "pooling_classify":
        path, body = "/pooling", {"input": [_text(rng) for _ in range(rng.randint(1, 6))], "task": "classify"}
    elif which == "tokenize":
        path, body = "/tokenize", {"prompt": _text(rng)}
    elif which == "abort_batch":
        body = {"input": [_text(rng, 60, 100) for _ in range(60)]}
        abort, expect = ("before_answer", rng.uniform(0.005, 0.05)), ("2xx", "4xx")
    elif which == "bad_too_many_inputs":
        body, expect = {"input": ["w7"] * 3000}, ("400",)
    elif which == "bad_over_max_model_len":
        body, expect = {"input": " ".join(["w7"] * 500)}, ("400",)
    elif which == "bad_too_many_tokens":
        body, expect = {"input": [" ".join(["w7"] * 120)] * 80}, ("400",)
    elif which == "bad_reply_too_large":  # token_embed: 20 x ~122 tokens x 64 > 65536 numbers
        path, body, expect = "/pooling", {"input": [" ".join(["w8"] * 120)] * 20, "task": "token_embed"}, ("400",)
    elif which == "bad_truncate_zero":
        body, expect = {"input": "w1", "truncate_prompt_tokens": 0}, ("400",)
    elif which == "bad_dimensions":
        body, expect = {"input": "w1", "dimensions": 1000}, ("400",)
    elif which == "bad_classify_task":
        path, body, expect = "/pooling", {"input": "w1", "task": "classify"}, ("400",)
    elif which == "bad_classify_route":
        path, body, expect = "/classify", {"input": "w1"}, ("404",)
    elif which == "bad_generation_route":
        path, body, expect = "/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]}, ("400",)
    elif which == "bad_empty_input":
        body, expect = {"input": []}, ("400",)
    elif which == "bad_token_out_of_vocab":
        body, expect = {"input": [[5, 10 ** 7]]}, ("400",)
    elif which == "bad_json":
        return Spec(f"pooling/{server}_{which}", path=path, body=b'{"input": ["w1", ', expect=("400",), server=server)
    elif which == "bad_too_many_documents":
        path, body, expect = "/rerank", {"query": "w1", "documents": ["w3"] * 3000}, ("400",)
    elif which == "bad_embeddings_route":
        body, expect = {"input": "w1"}, ("400",)
    elif which == "bad_pair_too_long":
        path, body, expect = "/score", {"text_1": " ".join(["w9"] * 100), "text_2": " ".join(["w9"] * 100)}, ("400",)
    elif which == "bad_empty_text":
        path, body, expect = "/score", {"text_1": [], "text_2": ["w1"]}, ("400",)
    else:
        raise ValueError(which)
    return Spec(f"pooling/{server}_{which}", path=path, body=_body(body), abort=abort, expect=expect, server=server)


GENERATORS = {"responses": responses_spec, "tools": tools_spec, "structured": structured_spec, "beam": beam_spec,
              "lora": lora_spec, "kv_tier": kv_tier_spec, "images": images_spec, "pooling": pooling_spec}


def base_share(surfaces: tuple[str, ...]) -> float:
    """The share of soak.py's default mix in a soak of these surfaces."""
    return 1.0 - sum(SHARES[s] for s in surfaces)


def surface_spec(rng: random.Random, r: float, i: int, ctx: Context, Spec):
    """The request for a draw ``r`` in [base_share, 1): the surface whose share it falls in."""
    acc = base_share(ctx.surfaces)
    for s in ctx.surfaces:
        acc += SHARES[s]
        if r < acc:
            return GENERATORS[s](rng, i, ctx, Spec)
    return GENERATORS[ctx.surfaces[-1]](rng, i, ctx, Spec)


def warmup_specs(seed: int, ctx: Context, Spec, per_surface: int = 6) -> list:
    """Well-formed requests of every surface (none that must fail), before the RSS baseline: each
    server has met each of its paths once (a LoRA slot, a grammar compile, the vision tower)."""
    rng = random.Random(seed + 99)
    out = []
    for s in ctx.surfaces:
        got = 0
        for k in range(400):
            spec = GENERATORS[s](rng, 10 ** 6 + k, ctx, Spec)
            if spec.expect[0] == "2xx" and spec.abort is None:
                out.append(spec)
                got += 1
                if got >= per_surface:
                    break
    return out


if __name__ == "__main__":  # python soak_surfaces.py build WORKDIR MODEL SURFACES: the assets as JSON
    if len(sys.argv) == 5 and sys.argv[1] == "build":
        print(json.dumps(build_assets(sys.argv[2], sys.argv[3], parse_surfaces(sys.argv[4]))))
    else:
        sys.exit(__doc__)
