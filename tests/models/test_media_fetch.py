"""Remote image URLs (issue 34, vLLM's --allowed-media-domains) against a local HTTP server: an
allowed host's image loads and equals the same image from a data: URL (also through a redirect
on the host); with no allowed domains, a host not in the list, user info in the URL, a redirect
to another host, a 404, an HTML body, a body over the size cap (declared or streamed) and a
server slower than the time limit (silent, or dripping bytes) are each a ContentError naming
the content part (the server's 400); the config checks its fields."""
from __future__ import annotations

import argparse
import base64
import time

import numpy as np
import pytest

from image_host import serving_sample_image
from pagedllm.multimodal.chat_content import ContentError, flatten_content
from pagedllm.multimodal.media import MediaSources, load_image

MEDIA = MediaSources(allowed_domains=("127.0.0.1",), fetch_timeout=0.5, fetch_max_bytes=256 << 10)


@pytest.fixture(scope="module")
def host():
    with serving_sample_image() as h:
        yield h


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def flatten(url: str, media):
    images: list = []
    flatten_content([{"type": "text", "text": "w1"}, {"type": "image_url", "image_url": {"url": url}}],
                    "<image>", images, media, "messages[0].content")
    return images


@pytest.mark.parametrize("path", ["/a.png", "/redirect-in"])
def test_allowed_host_image_equals_the_data_url_image(host, path):
    (img,) = flatten(host.url(path), MEDIA)
    same = load_image("data:image/png;base64," + base64.b64encode(host.png).decode())
    assert img.size == same.size and img.mode == same.mode
    assert np.array_equal(np.asarray(img), np.asarray(same))
    host_case = host.url(path).replace("http://", "HTTP://")  # the scheme and host are case-insensitive
    assert np.array_equal(np.asarray(load_image(host_case, MEDIA)), np.asarray(same))


@pytest.mark.parametrize("path, media, message", [
    ("/a.png", None, "remote image URLs are not fetched by this server (its --allowed-media-domains is unset)"),
    ("/a.png", MediaSources(allowed_domains=("example.com", "127.0.0.10")), "host '127.0.0.1' is not in the server's "
                                                                          "allowed_media_domains"),
    ("/redirect-out", MEDIA, "redirects to 'http://localhost:"),
    ("/missing", MEDIA, "answered HTTP 404"),
    ("/text", MEDIA, "the image URL's body is not a readable image"),
    ("/big", MEDIA, "over the server's limit of 262144 bytes (media_fetch_max_bytes)"),
    ("/big-declared", MEDIA, "over the server's limit of 262144 bytes"),
    ("/slow", MEDIA, "took longer than the server's limit of 0.5 s (media_fetch_timeout)"),
    ("/drip", MEDIA, "took longer than the server's limit of 0.5 s"),
])
def test_refused_fetch_names_the_part(host, path, media, message):
    t0 = time.monotonic()
    with pytest.raises(ContentError) as e:
        flatten(host.url(path), media)
    assert e.value.param == "messages[0].content[1].image_url" and message in str(e.value)
    assert time.monotonic() - t0 < 2.5  # /slow answers after 3 s, /drip takes 3 s: both stopped before


def test_url_tricks_are_refused(host):
    for url in (f"http://127.0.0.1@localhost:{host.port}/a.png",  # user info: the host is localhost
                f"http://x@127.0.0.1:{host.port}/a.png",          # user info at all
                "ftp://127.0.0.1/a.png"):
        with pytest.raises(ContentError, match=r"content\[1\]\.image_url: "):
            flatten(url, MEDIA)


def test_config_fields():
    from pagedllm.config import EngineConfig

    c = EngineConfig(allowed_media_domains="Upload.Wikimedia.org, 127.0.0.1 ::1", media_fetch_max_bytes="1MiB")
    assert c.allowed_media_domains == ("upload.wikimedia.org", "127.0.0.1", "::1")
    assert c.media_fetch_max_bytes == 1 << 20 and c.media_fetch_timeout == 5.0
    assert MediaSources.of_config(c) == MediaSources(None, c.allowed_media_domains, 5.0, 1 << 20)
    assert EngineConfig().allowed_media_domains == ()
    from pagedllm.entrypoints.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--allowed-media-domains", "A.com", "b.com", "--media-fetch-timeout", "2.5",
                              "--media-fetch-max-bytes", "2MiB"])
    c = engine_config_from_args(args)
    assert (c.allowed_media_domains, c.media_fetch_timeout, c.media_fetch_max_bytes) == (("a.com", "b.com"), 2.5,
                                                                                        2 << 20)
    for kw in ({"allowed_media_domains": ["https://x.com"]}, {"allowed_media_domains": ["x.com:80"]},
               {"allowed_media_domains": ["x.com/a"]}, {"media_fetch_timeout": 0}, {"media_fetch_max_bytes": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            EngineConfig(**kw)
