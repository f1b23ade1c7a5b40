"""LoRA adapters over the OpenAI server, with the official client: --lora-modules (name=path and
JSON), /v1/models with parent, the request's model picks the adapter (HF + PEFT's tokens), unknown
models 404, runtime load/unload behind --allow-runtime-lora-updating and the API key, bad
adapters refused with the reason while the server goes on, /metrics' lora_requests_info."""
import dataclasses
import json
import shutil
import socket
import threading
import time

import httpx
import openai
import pytest

from checkpoints import make_checkpoint
from peft_adapters import edit_config, hf_peft_greedy, make_adapter
from prompts import random_prompts

KEY = "sekrit"
NEW = 8
PROMPT = tuple(random_prompts((11,), seed=21)[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import uvicorn

    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import ServerArgs, build_app

    d = tmp_path_factory.mktemp("lora_server")
    base = make_checkpoint(str(d / "base"), "llama")
    sql = make_adapter(base, str(d / "sql"), r=8, seed=31)
    chat = make_adapter(base, str(d / "chat"), r=4, targets=("q_proj", "v_proj"), seed=32)
    extra = make_adapter(base, str(d / "extra"), r=8, targets=("o_proj", "down_proj"), seed=33)
    too_big = str(d / "too_big")
    shutil.copytree(extra, too_big)
    edit_config(too_big, r=64)
    args = ServerArgs(api_key=KEY, allow_runtime_lora_updating=True,
                      lora_modules=(f"sql={sql}", json.dumps({"name": "chat", "path": chat})))
    config = EngineConfig(model=base, served_model_name="tiny", dtype="float32", kv_cache_memory=8 << 20,
                          max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8)
    app = build_app(config, api_key=KEY, args=args)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    state = app.state.server
    deadline = time.monotonic() + 120
    while state.serving is None:
        assert state.load_error is None, state.load_error
        assert time.monotonic() < deadline, "engine did not load"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield dict(url=url, client=client, state=state, base=base, sql=sql, chat=chat, extra=extra, too_big=too_big)
    server.should_exit = True
    thread.join(30)


def complete(client, model):
    r = client.completions.create(model=model, prompt=list(PROMPT), max_tokens=NEW, temperature=0)
    assert r.model == model
    return r


def post(s, route, body, key=KEY):
    return httpx.post(s["url"] + route, json=body, headers={"Authorization": f"Bearer {key}"} if key else {})


def test_models_lists_adapters_with_their_parent(served):
    cards = {m.id: m for m in served["client"].models.list().data}
    assert set(cards) >= {"tiny", "sql", "chat"}
    assert cards["sql"].parent == "tiny" and cards["chat"].parent == "tiny" and cards["sql"].root == served["sql"]
    assert getattr(cards["tiny"], "parent", None) is None


def test_model_picks_the_adapter(served):
    client, base = served["client"], served["base"]
    tokens = {}
    for model, path in (("sql", served["sql"]), ("tiny", None), ("chat", served["chat"])):
        r = complete(client, model)
        tokens[model] = hf_peft_greedy(base, path, (PROMPT,), NEW)[0]
        assert r.choices[0].text.split() == served["state"].engine.tokenizer.decode(tokens[model]).split()
    assert len({str(t) for t in tokens.values()}) == 3
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "w4 w5"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "chat" and chat.choices[0].message.content is not None


def test_unknown_model_is_404(served):
    with pytest.raises(openai.NotFoundError) as e:
        complete(served["client"], "nope")
    assert e.value.body["code"] == "model_not_found"


def test_runtime_load_and_unload(served):
    client = served["client"]
    assert post(served, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": served["extra"]},
                key=None).status_code == 401  # behind the API key like every route
    r = post(served, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": served["extra"]})
    assert r.status_code == 200, r.text
    assert complete(client, "extra").choices[0].text.split() == served["state"].engine.tokenizer.decode(
        hf_peft_greedy(served["base"], served["extra"], (PROMPT,), NEW)[0]).split()
    again = post(served, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": served["extra"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = post(served, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": served["too_big"]})
    assert bad.status_code == 400 and "rank r=64 is above max_lora_rank=8" in bad.json()["error"]["message"]
    missing = post(served, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": "/nonexistent/adapter"})
    assert missing.status_code == 400 and "is not a directory" in missing.json()["error"]["message"]
    assert post(served, "/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400  # lora_path is required
    assert post(served, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "extra")
    assert post(served, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 404
    assert complete(client, "sql").choices[0].text  # the server goes on


def test_runtime_updating_is_off_by_default(served):
    state = served["state"]
    args = state.args
    state.args = dataclasses.replace(args, allow_runtime_lora_updating=False)
    try:
        r = post(served, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": served["extra"]})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
        assert post(served, "/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
    finally:
        state.args = args
    assert "sql" in {m.id for m in served["client"].models.list().data}


def test_metrics_show_lora_requests_info(served):
    complete(served["client"], "sql")
    text = httpx.get(served["url"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert ('pagedllm:lora_requests_info{max_lora="2",model_name="tiny",running_lora_adapters="",'
            'waiting_lora_adapters=""}') in text


def test_lora_modules_flags_parse():
    from pagedllm.entrypoints.cli import _build_parser
    from pagedllm.entrypoints.openai.lora_modules import parse_lora_modules

    args = _build_parser().parse_args(["serve", "m", "--enable-lora", "--lora-modules", "sql=/a",
                                       '{"name": "c", "path": "/b", "base_model_name": "m"}',
                                       "--allow-runtime-lora-updating"])
    assert args.enable_lora and args.allow_runtime_lora_updating
    reqs = parse_lora_modules(args.lora_modules)
    assert [(r.lora_name, r.lora_path, r.base_model_name) for r in reqs] == [("sql", "/a", None), ("c", "/b", "m")]
    for bad, why in (("sql", "not name=path"), ("=/a", "non-empty name"), ('{"name": "x"}', "needs string"),
                     ("a=/x", "given twice")):
        with pytest.raises(ValueError, match=why):
            parse_lora_modules(["a=/y", bad] if why == "given twice" else [bad])
