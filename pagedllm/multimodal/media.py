"""Images from what a caller hands over: a PIL image, a numpy array (H x W x 3 or H x W, uint8),
a ``data:`` URL (base64), a local file (a path or ``file://`` URL) under the directory the
operator allowed (``allowed_local_media_path``, vLLM's ``--allowed-local-media-path``; none by
default), or an ``http(s)://`` URL whose host the operator allowed (``allowed_media_domains``,
vLLM's ``--allowed-media-domains``; none by default: then every remote URL is refused).

An image over MAX_IMAGE_PIXELS, or one that takes its request's images over MAX_REQUEST_PIXELS
together (a PixelBudget the request's loads share), is refused from its header, before its pixels
are decoded.

A remote fetch (blocking: callers run it off the event loop) never follows a redirect by itself:
each hop's URL is checked again (scheme http/https, host in the list), at most MAX_REDIRECTS hops;
one wall-clock deadline (``media_fetch_timeout`` seconds) covers every hop's connect, status line,
headers and body: a connect waits at most the time left, and a timer shuts the fetch's sockets
down when it passes, so a server that drips bytes cannot hold a read past it (_Deadline); the
body is read in chunks and stopped once it passes ``media_fetch_max_bytes``. Every failure is a
ValueError saying what was wrong (the server answers it with a 400 naming the field)."""
from __future__ import annotations

import base64
import binascii
import functools
import io
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

MAX_IMAGE_PIXELS = 32 * 1024 * 1024  # larger images are refused before they are decoded
MAX_REQUEST_PIXELS = 64 * 1024 * 1024  # all the images of one request together, each counted before it is decoded
MAX_REDIRECTS = 5  # hops a remote image URL may redirect through (each to an allowed host)
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class MediaSources:
    """Where images named by a path or URL may come from (built once from the EngineConfig)."""
    local_path: Optional[str] = None  # allowed_local_media_path: None, no local files
    allowed_domains: tuple[str, ...] = ()  # lower-case host names, exact matches; (): no remote URLs
    fetch_timeout: float = 5.0  # seconds for one remote image: every hop and the whole body
    fetch_max_bytes: int = 20 << 20  # a larger remote body is stopped while it is read

    @classmethod
    def of_config(cls, config) -> "MediaSources":
        return cls(config.allowed_local_media_path, config.allowed_media_domains, config.media_fetch_timeout,
                   config.media_fetch_max_bytes)


_fetch_pool = None
FETCH_THREADS = 8  # remote image fetches (each waits on the network) run at once in the server


def fetch_pool():
    """The server's threads for flattening content parts that fetch remote images."""
    global _fetch_pool
    if _fetch_pool is None:
        from concurrent.futures import ThreadPoolExecutor

        _fetch_pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="pagedllm-media-fetch")
    return _fetch_pool


class PixelBudget:
    """The pixels one request's images have taken so far: load_image charges each image's size
    (known from its header) before decoding it, and refuses the image that would take the request
    over MAX_REQUEST_PIXELS."""

    def __init__(self, spent: int = 0) -> None:
        self.spent = spent

    @classmethod
    def after(cls, images: list) -> "PixelBudget":
        """The budget of a request whose ``images`` (PIL images) are loaded already."""
        return cls(sum(im.width * im.height for im in images))

    def charge(self, width: int, height: int) -> None:
        if self.spent + width * height > MAX_REQUEST_PIXELS:
            raise ValueError(f"the request's images come to more than the limit of {MAX_REQUEST_PIXELS} pixels "
                             f"together (this one is {width}x{height}, after {self.spent} pixels)")
        self.spent += width * height


def is_remote_url(source: Any) -> bool:
    return isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))


def _pil():
    try:
        import PIL.Image
    except ImportError:  # pragma: no cover - Pillow comes with the multimodal extra
        raise ValueError("image inputs need Pillow (pip install 'pagedllm[multimodal]')") from None
    return PIL.Image


def load_image(source: Any, media: Optional[MediaSources] = None, budget: Optional[PixelBudget] = None):
    """A PIL image (decoded, not yet converted to RGB) from any of the accepted sources;
    ``media`` None: no local files, no remote URLs; ``budget``: the request's PixelBudget, charged
    with this image (None: the image is counted alone)."""
    Image = _pil()
    media = media or MediaSources()
    budget = budget or PixelBudget()
    if isinstance(source, Image.Image):
        _check_size(source.size, budget)
        return source
    import numpy as np  # a dependency (the image processor imports it already)

    if isinstance(source, np.ndarray):
        return _from_array(Image, source, budget)
    if not isinstance(source, str):
        raise ValueError(f"an image must be a PIL image, a numpy array, a data: URL or a file path, got "
                         f"{type(source).__name__}")
    if source.startswith("data:"):
        return _decode(Image, _data_url_bytes(source), "the data: URL", budget)
    if is_remote_url(source):
        return _decode(Image, _remote_bytes(source, media), "the image URL's body", budget)
    if "://" in source and not source.startswith("file://"):
        raise ValueError(f"unsupported image URL scheme {source.split('://', 1)[0]!r} (data: URLs, or file:// "
                         "under the server's allowed_local_media_path, or http(s) from its allowed_media_domains)")
    return _decode(Image, _local_file_bytes(source, media.local_path), "the image file", budget)


def _check_size(size: tuple[int, int], budget: PixelBudget) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ValueError(f"the image is empty ({w}x{h})")
    if w * h > MAX_IMAGE_PIXELS:
        raise ValueError(f"the image is {w}x{h} pixels, over the limit of {MAX_IMAGE_PIXELS} pixels")
    budget.charge(w, h)


def _from_array(Image, arr, budget: PixelBudget):
    import numpy as np

    if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (1, 3, 4)):
        raise ValueError(f"a numpy image must be uint8 of shape (H, W), (H, W, 3) or (H, W, 4), got {arr.dtype} "
                         f"{tuple(arr.shape)}")
    _check_size((arr.shape[1], arr.shape[0]), budget)
    return Image.fromarray(arr[:, :, 0] if arr.ndim == 3 and arr.shape[2] == 1 else arr)


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ValueError("a data: URL needs a comma before its payload (data:image/png;base64,...)")
    mime, *params = header.split(";")
    if mime and not mime.startswith("image/"):
        raise ValueError(f"the data: URL holds {mime!r}, not an image")
    if "base64" not in params:
        raise ValueError("only base64 data: URLs are supported (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data: URL's payload is not valid base64") from None


def _local_file_bytes(path: str, allowed: Optional[str]) -> bytes:
    if path.startswith("file://"):
        path = path[len("file://"):]
    if not allowed:
        raise ValueError("local image files are not allowed on this server (its allowed_local_media_path is unset)")
    root = os.path.realpath(allowed)
    real = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
    if os.path.commonpath([root, real]) != root:
        raise ValueError("the image file is outside the server's allowed_local_media_path")
    if not os.path.isfile(real):
        raise ValueError("the image file does not exist")
    with open(real, "rb") as f:
        return f.read()


def _decode(Image, data: bytes, what: str, budget: PixelBudget):
    try:
        img = Image.open(io.BytesIO(data))
        _check_size(img.size, budget)  # before the pixels are decoded: a small file may claim a huge image
        img.load()
    except ValueError:
        raise
    except Exception as e:  # PIL raises many types for bad data (UnidentifiedImageError, OSError, ...)
        raise ValueError(f"{what} is not a readable image ({type(e).__name__})") from None
    return img


def _allowed_url(url: str, domains: tuple[str, ...], hop: int) -> str:
    """``url`` (reached after ``hop`` redirects) if its scheme is http(s) and its host one of
    ``domains``; else ValueError."""
    from urllib.parse import urlsplit
    from urllib.request import Request

    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # a malformed port raises here
    except ValueError:
        raise ValueError("the image URL is malformed") from None
    what = "the image URL's" if hop == 0 else f"the image URL redirects to {url!r}, whose"
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"the image URL redirects to a {parts.scheme!r} URL (only http and https are fetched)")
    if "@" in parts.netloc or not host or any(c.isspace() or c == "\\" for c in url):
        raise ValueError("the image URL must name a plain host (no user info, spaces or backslashes)")
    # urllib's own parsing of the URL must find the host the check saw (no parser differential)
    fetched = Request(url).host
    if parts.port is not None:
        fetched = fetched.rpartition(":")[0]
    if fetched.lower().strip("[]") != host:
        raise ValueError("the image URL's host is ambiguous")
    if host.rstrip(".") not in domains:
        raise ValueError(f"{what} host {host!r} is not in the server's allowed_media_domains (--allowed-media-domains)")
    return url


def _remote_bytes(url: str, media: MediaSources) -> bytes:
    if not media.allowed_domains:
        raise ValueError("remote image URLs are not fetched by this server (its --allowed-media-domains is unset): "
                         "send the image inline as a data: URL (data:image/png;base64,...)")
    deadline = _Deadline(media.fetch_timeout)
    try:
        return _fetch(url, media, deadline)
    except Exception:
        if deadline.expired():  # whatever broke (a read cut short, a garbled line), the deadline cut it
            raise _timed_out(media) from None
        raise
    finally:
        deadline.close()


def _fetch(url: str, media: MediaSources, deadline: "_Deadline") -> bytes:
    import http.client
    import urllib.error
    import urllib.request
    from urllib.parse import urljoin

    opener = _opener(deadline)
    for hop in range(MAX_REDIRECTS + 1):
        req = urllib.request.Request(_allowed_url(url, media.allowed_domains, hop),
                                     headers={"User-Agent": "pagedllm", "Accept": "image/*"})
        try:
            resp = opener.open(req, timeout=deadline.left())
        except urllib.error.HTTPError as e:
            location = e.headers.get("Location") if 300 <= e.code < 400 else None
            e.close()
            if location:
                url = urljoin(url, location)
                continue
            raise ValueError(f"fetching the image URL answered HTTP {e.code}") from None
        except (OSError, http.client.HTTPException) as e:  # URLError, a refused connection, TLS, a bad status line
            raise _fetch_error(e, media) from None
        with resp:
            if resp.status != 200:
                raise ValueError(f"fetching the image URL answered HTTP {resp.status}")
            return _read_capped(resp, deadline, media)
    raise ValueError(f"the image URL redirects more than {MAX_REDIRECTS} times")


def _read_capped(resp, deadline: "_Deadline", media: MediaSources) -> bytes:
    cap = media.fetch_max_bytes
    too_large = ValueError(f"the image URL's body is over the server's limit of {cap} bytes (media_fetch_max_bytes)")
    length = resp.headers.get("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > cap:
        raise too_large
    buf = bytearray()
    try:
        while True:
            deadline.left()
            chunk = resp.read1(_CHUNK)  # what one network wait brings (the deadline's timer ends a longer one)
            if not chunk:
                deadline.left()  # the end of a socket the timer shut down is no end of the body
                return bytes(buf)
            buf += chunk
            if len(buf) > cap:
                raise too_large
    except OSError as e:  # a timeout, a reset connection
        raise _fetch_error(e, media) from None
    except ValueError:
        raise
    except Exception as e:  # http.client's IncompleteRead and friends: a broken body
        raise ValueError(f"the image URL's body could not be read ({type(e).__name__})") from None


class _Deadline:
    """One remote fetch's wall-clock limit: every socket the fetch connects is watched (through a
    duplicate descriptor of its own, which TLS wrapping leaves alone), and a timer shuts them down
    when the time is up, so a TLS handshake, status line, header or body read blocked on a server
    that drips bytes returns at once. (A socket timeout only bounds each wait, not their sum.)"""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._shut = False
        self._timer = threading.Timer(seconds, self._shut_down)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        """Seconds left; TimeoutError when none are."""
        left = self.at - time.monotonic()
        if left <= 0 or self._shut:
            raise TimeoutError
        return left

    def expired(self) -> bool:
        return self._shut or time.monotonic() >= self.at

    def connect(self, create_connection, *args, **kwargs) -> socket.socket:
        """``create_connection(*args, **kwargs)``'s socket (http.client's connect), watched."""
        sock = create_connection(*args, **kwargs)
        with self._lock:
            self._socks.append(sock.dup())
            if self._shut:
                _shutdown(self._socks[-1])
        return sock

    def _shut_down(self) -> None:
        with self._lock:
            self._shut = True
            for sock in self._socks:
                _shutdown(sock)

    def close(self) -> None:
        """Stops the timer and lets go of the watched sockets (the fetch is over)."""
        self._timer.cancel()
        with self._lock:
            for sock in self._socks:
                sock.close()
            self._socks.clear()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # a recv blocked on it, in any thread, returns
    except OSError:  # already closed by the peer
        pass


def _timed_out(media: MediaSources) -> ValueError:
    return ValueError(f"fetching the image URL took longer than the server's limit of {media.fetch_timeout} s "
                      "(media_fetch_timeout)")


def _fetch_error(e: BaseException, media: MediaSources) -> ValueError:
    from urllib.error import URLError

    reason = e.reason if isinstance(e, URLError) else e  # URLError wraps the socket's error
    if isinstance(reason, TimeoutError) or isinstance(e, TimeoutError):
        return _timed_out(media)
    return ValueError(f"could not fetch the image URL ({type(reason).__name__}: {reason})")


def _opener(deadline: _Deadline):
    """A urllib opener that follows no redirect (a 3xx comes back as an HTTPError: _fetch checks
    the next hop itself) and whose HTTP and HTTPS connections connect through ``deadline``."""
    import urllib.request

    class NoRedirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            return None

    class Watched:
        def do_open(self, http_class, req, **kwargs):
            def connection(host, **conn_kwargs):
                conn = http_class(host, **conn_kwargs)
                conn._create_connection = functools.partial(deadline.connect, conn._create_connection)
                return conn

            return super().do_open(connection, req, **kwargs)

    class HTTP(Watched, urllib.request.HTTPHandler):
        pass

    class HTTPS(Watched, urllib.request.HTTPSHandler):
        pass

    return urllib.request.build_opener(NoRedirects(), HTTP(), HTTPS())
