"""Image inputs a hostile client sends (issue 34's hardening): a few-KB PNG of an extreme aspect
ratio, or of many megapixels of palette with transparency, stays small through the CLIP image
processor (peak memory measured in a child process); a region resize equals a full resize then
crop within 1 LSB, and transparency composited in strips equals it composited whole; the images
of one request share one pixel budget, charged from each header before decoding (chat messages
and multi_modal_data alike); a server that drips its status line, headers, a chunk-size line or
its body is cut off at the fetch deadline; images back to back whose newlines a tokenizer dropped
still count one each, and a run of placeholders is read as the given number of images (expanded
or not)."""
from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from pagedllm.multimodal import media
from pagedllm.multimodal.chat_content import ContentError, flatten_messages
from pagedllm.multimodal.image_processor import ClipImageProcessor, _kept_span, resize_region
from pagedllm.multimodal.media import MediaSources, load_image
from pagedllm.multimodal.processor import ImagePromptProcessor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def png_with(img: Image.Image, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **options)
    return buf.getvalue()


def png(img: Image.Image) -> bytes:
    return png_with(img)


def header_only(data: bytes) -> bytes:
    """A PNG cut just after its first IDAT chunk starts: PIL opens it (the size is known), but it
    cannot be decoded."""
    return data[:data.index(b"IDAT") + 8]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


# ---- extreme aspect ratios ------------------------------------------------------------------
PEAK = r"""
import base64, resource, sys
import PIL.Image, PIL.PngImagePlugin
from pagedllm.multimodal.image_processor import ClipImageProcessor
from pagedllm.multimodal.media import load_image

url = "data:image/png;base64," + base64.b64encode(open(sys.argv[1], "rb").read()).decode()
with open("/proc/self/status") as f:  # a regression fails with MemoryError, not with the machine's memory
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
shape = ClipImageProcessor()(load_image(url)).shape
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base, *shape)
"""


def hostile(mode: str, size: tuple[int, int]) -> Image.Image:
    if mode != "P":
        return Image.new(mode, size, {"L": 128, "RGB": (7, 200, 90), "RGBA": (7, 200, 90, 128)}[mode])
    img = Image.new("P", size)
    img.putpalette([0, 0, 0, 255, 255, 255])
    return img  # saved with index 0 transparent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB and /proc: Linux")
@pytest.mark.parametrize("mode, size", [("L", (1, 2_000_000)), ("RGB", (2_500_000, 1)), ("RGBA", (1, 20_000)),
                                        ("P", (5792, 5792))])
def test_a_few_kb_of_png_stays_small(tmp_path, mode, size):
    """A few KB of PNG whose full shortest-edge resize would be 224 x 448,000,000 (or 560,000,000
    x 224), or that decodes to 33.5 megapixels of palette with transparency: the child's peak
    stays under 256 MiB over its baseline. Before (Pillow 13): a 1 x 5,000 PNG of 146 bytes took
    2.4 GB, 1 x 10,000 and up past 3 GB, 1 x 1,000,000 a MemoryError; the palette image 501 MiB."""
    path = tmp_path / "hostile.png"
    hostile(mode, size).save(path, **({"transparency": 0} if mode == "P" else {}))
    assert path.stat().st_size < 16 << 10
    out = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-2000:]
    peak_kib, *shape = map(int, out.stdout.split())
    assert shape == [3, 224, 224]
    assert peak_kib < 256 << 10, f"{peak_kib / 1024:.0f} MiB over the baseline"


# What we found: PIL's box resize samples each output pixel at the same centre with the same filter
# support as the full resize, so a region resized alone equals the full resize's crop within 1 LSB
# (the centres' float rounding) -- when PIL runs its two passes in the same order. Pillow 13 picks
# the order by shape: a single box resize of a 40x900 image's crop ran vertical-first where the
# full resize ran horizontal-first, 38 LSB apart on this noise (the uint8 intermediate rounds and
# clips differently). resize_region therefore runs the passes itself, horizontal first; Pillow 13's
# full resize of a tall image that shrinks (300x5000 -> 224x3733) runs vertical-first, 25 LSB from
# it, which is why only resizes past FULL_RESIZE_MAX_CROPS crops take the region path.
@pytest.mark.parametrize("size", [(40, 900), (900, 40), (37, 1001), (1001, 37), (13, 777)])
@pytest.mark.parametrize("resample", [0, 1, 2, 3, 4, 5])
def test_region_resize_equals_full_resize_then_crop(size, resample):
    w, h = size
    img = Image.fromarray(np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8))
    proc = ClipImageProcessor()
    rh, rw = proc._resize_shape(h, w)
    (top, bottom), (left, right) = _kept_span(rh, 224), _kept_span(rw, 224)
    full = np.asarray(img.resize((rw, rh), resample).crop((left, top, right, bottom))).astype(int)
    region = np.asarray(resize_region(img, (rw, rh), (left, top, right, bottom), resample)).astype(int)
    assert region.shape == full.shape == (224, 224, 3)
    assert np.abs(region - full).max() <= 1


def test_processor_takes_the_region_path_only_past_the_limit(monkeypatch):
    """Up to FULL_RESIZE_MAX_CROPS crops PIL's full resize runs (the reference's pixel values, byte
    for byte: tests/models/test_llava.py); past it (forced here on a 40x900 image) the region path,
    within 1 LSB before rescale and normalize."""
    from pagedllm.multimodal import image_processor

    img = Image.fromarray(np.random.default_rng(3).integers(0, 256, (900, 40, 3), dtype=np.uint8))
    proc = ClipImageProcessor()
    calls = []
    monkeypatch.setattr(image_processor, "resize_region", lambda *a: calls.append(a) or resize_region(*a))
    full = proc(img)
    assert not calls  # 224 x 5040 is 22.5 crops
    monkeypatch.setattr(image_processor, "FULL_RESIZE_MAX_CROPS", 4)
    region = proc(img)
    assert len(calls) == 1 and region.shape == full.shape == (3, 224, 224)
    lsb = 1 / 255 / min(proc.image_std)
    np.testing.assert_allclose(region, full, rtol=0, atol=lsb * 1.001)


def test_padded_axis_is_kept_whole(monkeypatch):
    """A crop wider than the resized image (it pads there) and shorter: the region path pads as
    the full path does (an image that grows: one that shrinks, tall, Pillow 13 resizes vertically
    first, see above)."""
    from pagedllm.multimodal import image_processor

    proc = ClipImageProcessor(shortest_edge=16, crop_size=(24, 24))
    img = Image.fromarray(np.random.default_rng(5).integers(0, 256, (5000, 10, 3), dtype=np.uint8))
    calls = []
    monkeypatch.setattr(image_processor, "resize_region", lambda *a: calls.append(a) or resize_region(*a))
    region = proc(img)  # resized 16 x 8000: 222 crops
    monkeypatch.setattr(image_processor, "FULL_RESIZE_MAX_CROPS", 10 ** 9)
    full = proc(img)
    assert len(calls) == 1 and region.shape == full.shape == (3, 24, 24)
    black = (0 - np.array(proc.image_mean, np.float32)) / np.array(proc.image_std, np.float32)
    assert np.allclose(region[:, :, :4], black[:, None, None]) and np.allclose(region[:, :, 20:], black[:, None, None])
    np.testing.assert_allclose(region, full, rtol=0, atol=1.001 / 255 / min(proc.image_std))


def test_transparency_composited_in_strips_equals_it_composited_whole(monkeypatch):
    from pagedllm.multimodal import image_processor

    rng = np.random.default_rng(7)
    rgba = Image.fromarray(rng.integers(0, 256, (41, 29, 4), dtype=np.uint8), "RGBA")
    palette = Image.fromarray(rng.integers(0, 16, (41, 29), dtype=np.uint8), "P")
    palette.putpalette(list(rng.integers(0, 256, 48)))
    palette = Image.open(io.BytesIO(png_with(palette, transparency=bytes(rng.integers(0, 256, 16, np.uint8)))))
    levels = Image.fromarray(rng.integers(0, 4, (41, 29), np.uint8) * 60)
    gray = Image.open(io.BytesIO(png_with(levels, transparency=60)))
    for img in (rgba, rgba.convert("LA"), palette, gray):
        assert "A" in img.getbands() or "transparency" in img.info
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        whole = np.asarray(Image.alpha_composite(white, img.convert("RGBA")).convert("RGB"))  # transformers' way
        for strip in (1, 29 * 4, 29 * 6 + 5):
            monkeypatch.setattr(image_processor, "RGB_STRIP_PIXELS", strip)
            assert np.array_equal(np.asarray(image_processor.to_rgb(img)), whole)


# ---- one pixel budget a request -------------------------------------------------------------
def test_a_requests_images_share_one_budget_across_messages():
    """Two 4000x8000 images fit under MAX_REQUEST_PIXELS; a third, in another message, is refused
    from its header: it is only a PNG header, which decoding would call unreadable."""
    big = png(Image.new("1", (4000, 8000)))  # 32,000,000 pixels in a few KB
    assert len(big) < 16 << 10
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(big)}}] * 2},
            {"role": "user", "content": [{"type": "text", "text": "and"},
                                         {"type": "image_url", "image_url": {"url": data_url(header_only(big))}}]}]
    with pytest.raises(ContentError) as e:
        flatten_messages(msgs, "<image>")
    assert e.value.param == "messages[1].content[1].image_url"
    assert f"more than the limit of {media.MAX_REQUEST_PIXELS} pixels together" in str(e.value)
    assert "(this one is 4000x8000, after 64000000 pixels)" in str(e.value)
    with pytest.raises(ContentError, match="not a readable image"):  # alone, the header gets as far as decoding
        flatten_messages(msgs[1:], "<image>")


def test_multi_modal_data_images_share_one_budget(monkeypatch):
    monkeypatch.setattr(media, "MAX_REQUEST_PIXELS", 3000)
    proc = ImagePromptProcessor(9, 2, ClipImageProcessor(shortest_edge=8, crop_size=(8, 8)))
    small = Image.new("RGB", (40, 30), (1, 2, 3))  # 1200 pixels
    ids = [5, 9, 6, 9, 7, 9]
    out, feats = proc.process(ids, [small, np.zeros((30, 40, 3), np.uint8), small.resize((10, 10))])
    assert len(feats) == 3
    with pytest.raises(ValueError, match=r"image 2: the request's images come to more than the limit of 3000 pixels"):
        proc.process(ids, [small, np.zeros((30, 40, 3), np.uint8), data_url(header_only(png(small)))])
    out, feats = proc.process([9], [small])  # each request starts afresh
    assert len(feats) == 1


# ---- the fetch deadline over a dripping server ----------------------------------------------
class DripServer:
    """A TCP server on 127.0.0.1 for one connection: reads the request, sends ``at_once``, then
    ``dripped`` one byte every ``gap`` s; it stops when the client hangs up (a send fails)."""

    def __init__(self, at_once: bytes, dripped: bytes, gap: float = 0.2) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(30)
        self.port = self.listener.getsockname()[1]
        self.sent = 0
        self.thread = threading.Thread(target=self._serve, args=(at_once, dripped, gap), daemon=True)
        self.thread.start()

    def _serve(self, at_once: bytes, dripped: bytes, gap: float) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(4096) or b"\r\n\r\n"
                conn.sendall(at_once)
                for byte in dripped:
                    time.sleep(gap)
                    conn.sendall(bytes([byte]))
                    self.sent += 1
        except OSError:  # the client hung up
            pass
        finally:
            self.listener.close()


@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"


@pytest.mark.parametrize("at_once, dripped", [
    (b"", HEAD + b"X-Pad: " + b"a" * 200 + b"\r\n\r\n"),  # the status line and headers, a byte at a time
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"0" * 200),  # a chunk-size line that never ends
    (HEAD + b"Content-Length: 400\r\n\r\n", b"\0" * 400),  # the body, a byte at a time
], ids=["headers", "chunk-size", "body"])
def test_dripping_server_is_cut_off_at_the_deadline(no_proxy, at_once, dripped):
    server = DripServer(at_once, dripped)
    sources = MediaSources(allowed_domains=("127.0.0.1",), fetch_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"took longer than the server's limit of 1\.0 s \(media_fetch_timeout\)"):
        load_image(f"http://127.0.0.1:{server.port}/a.png", sources)
    assert time.monotonic() - t0 < 1.0 + 4  # not the 40+ s the drip would take
    server.thread.join(5)
    assert not server.thread.is_alive() and server.sent < len(dripped)


# ---- placeholders back to back --------------------------------------------------------------
IMAGE = 9
PROC = ImagePromptProcessor(IMAGE, 2, ClipImageProcessor(shortest_edge=8, crop_size=(8, 8)))


def whitespace_ids(text: str) -> list[int]:
    """A tiny tokenizer that splits on whitespace (newlines vanish)."""
    return [IMAGE if word == "<image>" else 10 + len(word) for word in text.split()]


def test_three_images_back_to_back_in_a_chat_message():
    imgs = [Image.new("RGB", (12, 10), (i, 0, 0)) for i in (10, 20, 30)]
    msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": im} for im in imgs]
             + [{"type": "text", "text": "what"}]}]
    flat, images = flatten_messages(msgs, "<image>")
    assert flat[0]["content"] == "<image>\n<image>\n<image>\nwhat"
    ids = whitespace_ids(flat[0]["content"])
    assert ids == [IMAGE] * 3 + [14]
    out, feats = PROC.process(ids, images)
    assert out == [IMAGE] * 6 + [14]
    assert [f.offset for f in feats] == [0, 2, 4]


@pytest.mark.parametrize("ids, num_images, runs", [
    ([5, 9, 9, 6], 1, [(1, 2)]),                     # one image, already expanded
    ([5, 9, 9, 6], 2, [(1, 1), (2, 1)]),             # two images, unexpanded
    ([9, 9, 9, 9], 2, [(0, 2), (2, 2)]),             # two expanded
    ([9, 9, 9, 9], 4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
    ([9, 9, 9], 3, [(0, 1), (1, 1), (2, 1)]),        # odd: unexpanded only
    ([9, 9, 5, 9, 9], 3, [(0, 2), (3, 1), (4, 1)]),  # the earlier run expanded first
    ([9, 9, 5, 9, 9], 4, [(0, 1), (1, 1), (3, 1), (4, 1)]),
])
def test_a_run_is_read_as_the_given_number_of_images(ids, num_images, runs):
    assert PROC._placeholder_runs(ids, num_images) == runs


@pytest.mark.parametrize("ids, num_images, message", [
    ([9, 9, 9, 9], 3, r"has 2 \(or 4 unexpanded\) image placeholder\(s\) \('<image>'\) but 3 image\(s\)"),
    ([9, 9, 9], 2, r"has 3 image placeholder\(s\) \('<image>'\) but 2 image\(s\)"),
    ([5, 6], 1, r"has 0 image placeholder\(s\) \('<image>'\) but 1 image\(s\)"),
])
def test_no_reading_matches(ids, num_images, message):
    with pytest.raises(ValueError, match=message):
        PROC.process(ids, [Image.new("RGB", (4, 4))] * num_images)
