"""Images through the server's chat route (issue 34): image_url content parts as data: URLs and
as local files under --allowed-local-media-path and as http(s) URLs from --allowed-media-domains
(a local HTTP server), greedy tokens equal to HF's LLaVA, the prefix cache
hitting for the same image and stopping where another image begins (usage.cached_tokens), and
400s naming the content part for bad base64, undecodable bytes, http(s) URLs of a host not
allowed, a missing remote image and files outside the allowed directory; no request leaves a block behind."""
from __future__ import annotations

import base64
import io

import httpx
import pytest
from conftest import LiveServer, wait_idle, wait_ready
from image_host import serving_sample_image
from llava_checkpoints import hf_llava_greedy, make_llava_checkpoint, sample_images


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server(ckpt_dir, tmp_path_factory):
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import build_app

    path = make_llava_checkpoint(str(ckpt_dir / "llava"))
    media = tmp_path_factory.mktemp("media")
    live = wait_ready(LiveServer(build_app(EngineConfig(
        model=path, served_model_name="llava", dtype="float32", block_size=4, kv_cache_memory=4 << 20,
        max_model_len=256, allowed_local_media_path=str(media), allowed_media_domains=("127.0.0.1",)))))
    yield live, path, media
    live.stop()


@pytest.fixture(scope="module")
def image_host():
    with serving_sample_image() as host:
        yield host


def chat(live, *parts, **kw):
    content = [{"type": "text", "text": "w1 w2 w3 w4 w5"}, *parts]
    body = {"model": "llava", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **kw}
    return httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_data_url_and_local_file_images(server):
    live, path, media = server
    a, b, _ = sample_images()
    r = chat(live, image_part(data_url(a)), {"type": "text", "text": "w6"})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["prompt_token_ids"]
    assert body["choices"][0]["token_ids"] == hf_llava_greedy(path, [(ids, [a])], 6)[0]
    again = chat(live, image_part(data_url(a)), {"type": "text", "text": "w6"}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 24  # 26 prompt tokens, blocks of 4
    assert again["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]
    b.save(media / "b.png")
    other = chat(live, image_part(f"file://{media}/b.png"), {"type": "text", "text": "w6"}).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 4  # the image starts in block 1
    assert other["choices"][0]["token_ids"] == hf_llava_greedy(path, [(other["prompt_token_ids"], [b])], 6)[0]
    wait_idle(live.engine)


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a readable image"),
    ("https://example.com/cat.png", "host 'example.com' is not in the server's allowed_media_domains"),
    ("file:///etc/hostname", "outside the server's allowed_local_media_path"),
])
def test_bad_image_is_400_naming_the_part(server, url, message):
    live = server[0]
    r = chat(live, image_part(url))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].image_url" and message in err["message"]


def test_image_from_an_allowed_host(server, image_host, monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    live = server[0]
    a = sample_images()[0]
    inline = chat(live, image_part(data_url(a)), {"type": "text", "text": "w7"}).json()
    remote = chat(live, image_part(image_host.url("/a.png")), {"type": "text", "text": "w7"})
    assert remote.status_code == 200, remote.text
    body = remote.json()
    assert body["prompt_token_ids"] == inline["prompt_token_ids"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 24  # the same image: the same block hashes
    assert body["choices"][0]["token_ids"] == inline["choices"][0]["token_ids"]
    missing = chat(live, image_part(image_host.url("/missing")))
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages[0].content[1].image_url"
    assert "answered HTTP 404" in missing.json()["error"]["message"]
    wait_idle(live.engine)


def test_placeholder_count_mismatch_is_400(server):
    live = server[0]
    r = chat(live, {"type": "text", "text": "<image> w9"}, image_part(data_url(sample_images()[0])))
    assert r.status_code == 400 and "2 image placeholder(s)" in r.json()["error"]["message"]
    wait_idle(live.engine)


def test_mm_processor_kwargs_refused_by_an_image_model(server):
    live = server[0]
    part = image_part(data_url(sample_images()[0]))
    r = chat(live, part, mm_processor_kwargs={"do_resize": False})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "mm_processor_kwargs" and "do_resize" in err["message"]
    assert chat(live, part, mm_processor_kwargs={}).status_code == 200  # empty: nothing asked
    wait_idle(live.engine)
