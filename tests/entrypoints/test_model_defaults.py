"""What the server takes from the model and the operator: generation_config.json sampling
defaults for fields a request leaves unset, --chat-template and chat_template_kwargs, and
prompt_logprobs in vLLM's response shape."""
from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
from conftest import ENGINE_KW, start_live

MSGS = [{"role": "user", "content": "w5 w6 w7"}]


def start(path, args=None, **engine_kw):
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import ServerArgs

    return start_live(EngineConfig(model=path, served_model_name="tiny", **{**ENGINE_KW, **engine_kw}),
                      args or ServerArgs())


@pytest.fixture(scope="module")
def gen_model(llama_ckpt, tmp_path_factory):
    """The test checkpoint with a generation_config.json recommending greedy decoding, 5 tokens."""
    path = str(tmp_path_factory.mktemp("genmodel") / "m")
    shutil.copytree(llama_ckpt, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.0, "max_new_tokens": 5, "eos_token_id": 2}, f)
    return path


TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}{% if extra %}{{ extra }}{% endif %}"


@pytest.fixture(scope="module")
def gen_server(gen_model):
    """Over gen_model, with --chat-template TEMPLATE."""
    from pagedllm.entrypoints.openai.api_server import ServerArgs

    live = start(gen_model, ServerArgs(chat_template=TEMPLATE))
    yield live
    live.stop()


def chat(url, **body):
    r = httpx.post(url + "/v1/chat/completions", json={"messages": MSGS, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_unset_fields_take_the_generation_config(gen_server):
    a = chat(gen_server.url, ignore_eos=True)  # temperature and max_tokens unset: greedy, 5 tokens
    b = chat(gen_server.url, ignore_eos=True)
    assert a["usage"]["completion_tokens"] == 5 and a["choices"][0]["finish_reason"] == "length"
    assert a["choices"][0]["message"] == b["choices"][0]["message"]  # greedy: the same text each time
    explicit = chat(gen_server.url, ignore_eos=True, temperature=0, max_tokens=5)
    assert explicit["choices"][0]["message"] == a["choices"][0]["message"]
    assert chat(gen_server.url, ignore_eos=True, max_tokens=7)["usage"]["completion_tokens"] == 7  # a set field wins
    r = httpx.post(gen_server.url + "/v1/completions", json={"prompt": "w5 w6", "ignore_eos": True, "max_tokens": None},
                   timeout=60).json()
    assert r["usage"]["completion_tokens"] == 5


def test_generation_config_vllm_ignores_the_file(gen_model):
    live = start(gen_model, generation_config="vllm", max_model_len=48)  # a short context: few tokens to fill it
    try:
        assert live.state.engine.default_sampling_params == {}
        r = chat(live.url, ignore_eos=True, max_tokens=None)
        assert r["usage"]["completion_tokens"] == 48 - r["usage"]["prompt_tokens"]  # the context's room
    finally:
        live.stop()


# ---- --chat-template and chat_template_kwargs ---------------------------------------------------
def tokenize(url, **body):
    return httpx.post(url + "/tokenize", json={"messages": MSGS, **body}, timeout=60)


def test_server_chat_template_and_kwargs(gen_server):
    tok = gen_server.state.engine.tokenizer
    r = tokenize(gen_server.url)
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("w5 w6 w7 ", add_special_tokens=False)
    r = tokenize(gen_server.url, chat_template_kwargs={"extra": "w9"})
    assert r.json()["tokens"] == tok.encode("w5 w6 w7 w9", add_special_tokens=False)
    c = chat(gen_server.url, chat_template_kwargs={"extra": "w9"}, max_tokens=2)
    assert c["usage"]["prompt_tokens"] == 4
    for key in ("messages", "tokenize", "bos_token", "not-a-name"):
        r = httpx.post(gen_server.url + "/v1/chat/completions",
                       json={"messages": MSGS, "chat_template_kwargs": {key: 1}}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}", r.text


def test_chat_template_flag_file_string_and_errors(tmp_path):
    from pagedllm.tokenizer.chat_template import load_chat_template

    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE == load_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="looks like a file path, but there is no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid template"):
        load_chat_template("{% if %}")


def test_serve_with_a_bad_chat_template_exits_with_one_line(llama_ckpt, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", llama_ckpt, "--chat-template",
                        str(tmp_path / "missing.jinja")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "no such file" in r.stderr


# ---- prompt_logprobs ---------------------------------------------------------------------------
def test_prompt_logprobs_in_vllm_shape(server, offline):
    from pagedllm.sampling_params import SamplingParams

    r = httpx.post(server.url + "/v1/completions", json={"prompt": "w5 w6 w7 w8", "max_tokens": 1, "temperature": 0,
                                                         "prompt_logprobs": 2}, timeout=60)
    assert r.status_code == 200, r.text
    ids = server.engine.tokenizer.encode("w5 w6 w7 w8")
    ref = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=2),
                           use_tqdm=False)[0].prompt_logprobs
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(ids) == r.json()["usage"]["prompt_tokens"] and pl[0] is None
    for j in range(1, len(ids)):
        entry = pl[j][str(ids[j])]  # keyed by token id; the prompt's own token is always there
        assert set(entry) == {"logprob", "rank", "decoded_token"} and entry["rank"] >= 1
        assert abs(entry["logprob"] - ref[j][ids[j]].logprob) < 1e-4
        assert 1 <= len(pl[j]) <= 3 and sorted(v["rank"] for v in pl[j].values())[:2] == [1, 2]
    c = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "prompt_logprobs": 0},
                   timeout=60).json()
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    assert all(len(d) == 1 for d in c["prompt_logprobs"][1:])  # 0: only the prompt's token
    assert "prompt_logprobs" not in c["choices"][0]
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 1}, timeout=60).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize("body", [{"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21},
                                  {"prompt_logprobs": True}])
def test_prompt_logprobs_bad_requests_name_the_field(server, body):
    for path, base in (("/v1/completions", {"prompt": "w5"}), ("/v1/chat/completions", {"messages": MSGS})):
        r = httpx.post(server.url + path, json={**base, "max_tokens": 1, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
