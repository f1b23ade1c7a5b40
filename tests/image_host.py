"""A local HTTP server on 127.0.0.1, in a thread, for the remote image URL tests (issue 34):
``/a.png`` (an image), ``/redirect-in`` (302 to /a.png on the same host), ``/redirect-out`` (302
to the same file on ``localhost``, another host name), ``/missing`` (404), ``/text`` (an HTML
page), ``/big`` (an endless body with no Content-Length), ``/big-declared`` (a Content-Length
over any test cap), ``/slow`` (answers after 3 s) and ``/drip`` (headers, then a byte every
0.05 s for 3 s)."""
from __future__ import annotations

import contextlib
import http.server
import io
import threading
import time


class ImageHost:
    def __init__(self, png: bytes) -> None:
        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                try:
                    host._answer(self)
                except OSError:  # the client gave up (a test's cap or deadline): expected
                    pass

        self.png = png
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def _answer(self, h) -> None:
        path = h.path
        if path in ("/redirect-in", "/redirect-out"):
            h.send_response(302)
            h.send_header("Location", "/a.png" if path == "/redirect-in" else self.url("/a.png", "localhost"))
            h.end_headers()
            return
        if path == "/slow":
            time.sleep(3)
        status, body = {"/a.png": (200, self.png), "/slow": (200, self.png), "/text": (200, b"<html>hi</html>")}.get(
            path, (404, b"no")) if path not in ("/big", "/big-declared", "/drip") else (200, b"")
        h.send_response(status)
        h.send_header("Content-Type", "text/html" if path == "/text" else "image/png")
        if path == "/big-declared":
            h.send_header("Content-Length", str(1 << 30))
        elif path not in ("/big", "/drip"):
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if path in ("/big", "/big-declared"):
            for _ in range(256):  # 16 MiB at most
                h.wfile.write(b"\0" * 65536)
        elif path == "/drip":
            for _ in range(60):
                h.wfile.write(b"\0")
                h.wfile.flush()
                time.sleep(0.05)
        else:
            h.wfile.write(body)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def serving_sample_image():
    """An ImageHost whose /a.png is llava_checkpoints.sample_images()[0], as PNG."""
    from llava_checkpoints import sample_images

    buf = io.BytesIO()
    sample_images()[0].save(buf, format="PNG")
    host = ImageHost(buf.getvalue())
    try:
        yield host
    finally:
        host.stop()
