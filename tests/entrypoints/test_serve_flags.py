"""vLLM's serve flags: several served names (all routable), CORS, TLS through uvicorn, root path,
--max-logprobs, --response-role, --disable-fastapi-docs, --override-generation-config,
--enable-log-requests / --disable-log-stats, and the flags parsed as vLLM spells them."""
from __future__ import annotations

import logging
import shutil
import ssl
import subprocess

import httpx
import pytest

from conftest import serve_shared  # noqa: E402


def _serve(server, **server_args):
    """An app with these flags over the shared server's engine (they are the front end's)."""
    from pagedllm.entrypoints.openai.api_server import ServerArgs

    return serve_shared(server, ServerArgs(**server_args))


@pytest.fixture(scope="module")
def flagged(server):
    live = _serve(server, served_model_names=("tiny", "alias"), allowed_origins=("http://ui.test",),
                  response_role="bot", max_logprobs=2, disable_fastapi_docs=True, enable_log_requests=True,
                  disable_log_stats=True, override_generation_config='{"temperature": 0, "max_new_tokens": 5}')
    yield live
    live.stop()


def test_several_served_names_all_routable(flagged):
    import openai

    client = openai.OpenAI(base_url=flagged.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data][:2] == ["tiny", "alias"]
    assert client.models.retrieve("alias").id == "alias"
    r = client.completions.create(model="alias", prompt="w1 w2", max_tokens=2)
    assert r.model == "alias" and r.choices[0].text is not None


def test_cors_preflight_and_headers(flagged):
    pre = httpx.options(flagged.url + "/v1/completions", headers={
        "Origin": "http://ui.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.test"
    r = httpx.get(flagged.url + "/v1/models", headers={"Origin": "http://ui.test"})
    assert r.headers["access-control-allow-origin"] == "http://ui.test"
    other = httpx.get(flagged.url + "/v1/models", headers={"Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in other.headers


def test_role_logprob_cap_docs_and_generation_override(flagged, caplog):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}]}
    with caplog.at_level(logging.INFO, logger="pagedllm.server"):
        r = httpx.post(flagged.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["message"]["role"] == "bot"
    assert r["usage"]["completion_tokens"] <= 5  # the override's max_new_tokens
    assert any("request chatcmpl-" in rec.getMessage() for rec in caplog.records)  # --enable-log-requests
    again = httpx.post(flagged.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert again["choices"][0]["message"]["content"] == r["choices"][0]["message"]["content"]  # temperature 0
    bad = httpx.post(flagged.url + "/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
    bad = httpx.post(flagged.url + "/v1/completions", json={"model": "tiny", "prompt": "w1", "logprobs": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"
    assert httpx.get(flagged.url + "/openapi.json").status_code == 404


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(server, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    live = _serve(server, ssl_keyfile=str(key), ssl_certfile=str(cert), root_path="/llm")
    try:
        url = live.url.replace("http://", "https://")
        r = httpx.get(url + "/v1/models", verify=ssl.create_default_context(cafile=str(cert)))
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
        with pytest.raises(httpx.HTTPError):
            httpx.get(live.url + "/v1/models", timeout=5)  # plain HTTP on the TLS port
    finally:
        live.stop()


def test_server_args_are_checked(tmp_path):
    from pagedllm.entrypoints.openai.api_server import ServerArgs

    for kw, word in (({"max_logprobs": 50}, "max_logprobs"), ({"ssl_keyfile": "k"}, "ssl"),
                     ({"ssl_keyfile": str(tmp_path / "no"), "ssl_certfile": str(tmp_path / "no")}, "no such file"),
                     ({"override_generation_config": "{bad"}, "override_generation_config"),
                     ({"override_generation_config": '{"beam": 1}'}, "override_generation_config"),
                     ({"root_path": "llm"}, "root_path")):
        with pytest.raises(ValueError, match=word):
            ServerArgs(**kw)


def test_vllm_command_line_parses():
    from pagedllm.entrypoints.cli import _build_parser, sub_parser

    parser = _build_parser()
    args = parser.parse_args([
        "serve", "/models/m", "--served-model-name", "a", "b", "--uvicorn-log-level", "warning",
        "--enable-log-requests", "--disable-log-stats", "--max-logprobs", "5", "--allowed-origins", '["*"]',
        "--root-path", "/x", "--response-role", "bot", "--disable-fastapi-docs", "--trust-remote-code",
        "--load-format", "safetensors", "--override-generation-config", '{"temperature": 0.5}',
        "--structured-outputs-config", '{"backend": "xgrammar"}'])
    assert args.model_pos == "/models/m" and args.served_model_name == ["a", "b"]  # "b" is not the model
    assert args.allowed_origins == ["*"] and args.max_logprobs == 5 and args.load_format == "safetensors"
    srv = sub_parser(parser, "serve")
    with pytest.raises(SystemExit):
        srv.parse_args(["--load-format", "pt"])
    with pytest.raises(SystemExit):
        srv.parse_args(["--structured-outputs-config", '{"backend": "outlines"}'])
