"""What every HTTP front of ours (the OpenAI server, the router) does with a request before its
app sees it: the API key is checked before a byte of the body is read, and the body -- on every
route and method -- is read here, bounded in size (413, also for a chunked body without a
Content-Length) and in the time between chunks (408), then replayed to the app. Also the
listening socket (``listen_socket``: a bad host or a port in use is one clear error before
anything starts) and uvicorn's HTTP protocol and event loop (``http_protocol``, ``event_loop``).
Nothing here imports the engine (the router runs without it)."""
from __future__ import annotations

import asyncio
import json
import secrets
import socket
from typing import Callable, Collection, Optional

ErrorFactory = Callable[..., object]  # (status, message, code, headers) -> an ASGI response


# Pages a browser opens (the OpenAI server's /dashboard): a browser cannot send a bearer token
# there, so these paths also take HTTP Basic credentials whose password is the key.
BROWSER_PATH_PREFIX = "/dashboard"


def is_browser_page(path: str) -> bool:
    """The dashboard's pages, and on a multi-model server each model's (/models/NAME/dashboard...)."""
    if path.startswith("/models/"):
        path = "/" + path.split("/", 3)[-1] if path.count("/") >= 3 else path
    return path == BROWSER_PATH_PREFIX or path.startswith(BROWSER_PATH_PREFIX + "/")


def basic_password(token: bytes) -> bytes:
    """The password of HTTP Basic credentials (base64 of user:password); b"" if malformed."""
    import base64
    import binascii

    try:
        return base64.b64decode(token, validate=True).partition(b":")[2]
    except (binascii.Error, ValueError):
        return b""


def authorized(headers: dict, key: bytes, allow_basic: bool = False) -> bool:
    """Whether the request's ``Authorization: Bearer <key>`` header carries ``key`` (or, with
    ``allow_basic``, ``Authorization: Basic`` credentials with ``key`` as the password)."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if allow_basic and scheme.lower() == b"basic":
        return secrets.compare_digest(basic_password(token.strip()), key)
    return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), key)


def has_body(headers: dict) -> bool:
    """Whether the request says it carries a body (a Content-Length above 0, or chunked)."""
    return headers.get(b"content-length", b"0").strip() not in (b"0", b"") or b"transfer-encoding" in headers


def declared_length(headers: dict) -> int:
    try:
        return int(headers.get(b"content-length", b"-1"))
    except ValueError:
        return -1


async def read_body(receive, limit: int, timeout: float):
    """The whole body, read at most ``limit`` bytes far with at most ``timeout`` seconds between
    chunks: bytes, or ``("too_large", size)`` / ``("timeout", None)`` / ``("disconnect", None)``."""
    chunks, size = [], 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), timeout)
        except asyncio.TimeoutError:
            return "timeout", None
        if message["type"] == "http.disconnect":
            return "disconnect", None
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            return "too_large", size
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


# A refused request's body is read and dropped up to this many bytes before the answer goes out,
# as nginx's lingering close does: closing a connection with unread bytes resets it, and a client
# still sending (httpx, requests, a router forwarding the body) would see the reset, not the answer.
# A body declared larger than this is not read: its connection is closed with the answer.
DRAIN_LIMIT = 64 << 20


async def drain_body(receive, already: int, declared: int, timeout: float) -> None:
    """Read and drop the rest of a body (``already`` bytes of it read so far), unless it is
    declared over DRAIN_LIMIT; stops at DRAIN_LIMIT, a disconnect, or ``timeout`` seconds
    without a chunk."""
    if declared > DRAIN_LIMIT:
        return
    size = already
    while size <= DRAIN_LIMIT:
        try:
            message = await asyncio.wait_for(receive(), timeout)
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def too_large_message(size: int, limit: int) -> str:
    return (f"the request body is {'at least ' if size <= limit else ''}{size} bytes; this server accepts at most "
            f"{limit} (--max-request-body-size)")


async def guard_body(scope, receive, send, state, error: ErrorFactory, json_paths: Collection[str],
                     open_paths: Collection[str]) -> Optional[Callable]:
    """Check one HTTP request; answer it here (401, 413, 408, 415; None returned) or return the
    ``receive`` the app gets (the body read and bounded, replayed). ``state`` gives ``api_key``
    (None: no key), ``max_body_size`` (bytes) and ``http_read_timeout`` (seconds between chunks).
    A refusal of an authorised request reads and drops its body first (drain_body), then closes
    the connection (``Connection: close``)."""
    headers = dict(scope["headers"])
    body_coming = has_body(headers)
    close = {"Connection": "close"} if body_coming else None
    key = state.api_key
    page = is_browser_page(scope["path"])
    limit, timeout = state.max_body_size, state.http_read_timeout
    declared = declared_length(headers)
    if key and scope["path"] not in open_paths and scope["method"] != "OPTIONS" \
            and not authorized(headers, key.encode(), allow_basic=page):
        if page:  # the browser asks for the credentials
            close = {**(close or {}), "WWW-Authenticate": 'Basic realm="pagedllm dashboard"'}
        # not drained: a client without the key gets no byte of its body read
        await error(401, "Incorrect or missing API key: pass 'Authorization: Bearer <key>'.", "invalid_api_key",
                    close)(scope, receive, send)
        return None
    if scope["method"] == "POST" and scope["path"] in json_paths:
        ctype = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        if ctype and ctype != "application/json" and not ctype.endswith("+json"):
            if body_coming:
                await drain_body(receive, 0, declared, timeout)
            await error(415, f"the Content-Type must be application/json, got {ctype!r}", "unsupported_media_type",
                        close)(scope, receive, send)
            return None
    elif not body_coming:
        return receive
    body = await read_body(receive, limit, timeout) if declared <= limit else ("too_large", declared)
    if isinstance(body, tuple):
        what, size = body
        if what == "too_large":
            await drain_body(receive, size if declared <= limit else 0, declared, timeout)
            await error(413, too_large_message(size, limit), "request_too_large",
                        {"Connection": "close"})(scope, receive, send)
        elif what == "timeout":
            await error(408, f"the request body was not received: nothing arrived for {timeout:g} s", "body_timeout",
                        {"Connection": "close"})(scope, receive, send)
        return None
    replay = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_replayed():
        return replay.pop() if replay else await receive()

    return receive_replayed


def _invalid_http_body(msg: str) -> bytes:
    return json.dumps({"error": {"message": f"invalid HTTP request: {msg.rstrip('.')}",
                                 "type": "invalid_request_error", "param": None, "code": "invalid_http"}}).encode()


# The most bytes a request line and its headers may take (nginx allows 4 x 8 KiB; h11 refuses past
# 16 KiB itself): past it the answer is 431 and the connection closes, before more is buffered.
MAX_HEADER_BYTES = 64 << 10


def _headers_too_large_response() -> bytes:
    data = json.dumps({"error": {"message": f"the request line and headers are over {MAX_HEADER_BYTES} bytes",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "headers_too_large"}}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def _guarded(base, header_timeout: float):
    """``base`` (one of uvicorn's HTTP/1.1 protocols) closing a connection that does not deliver a
    request's headers within ``header_timeout`` seconds of connecting or of sending its first
    bytes after the previous response (idle keep-alive connections are uvicorn's
    timeout_keep_alive), and answering 431 to headers over MAX_HEADER_BYTES (httptools buffers
    any size). The subclass adds its parser's JSON answer to unparseable requests."""

    class _HeaderTimeout(base):
        _header_timer = None
        _header_bytes = 0  # bytes received while the current request's headers are incomplete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._expired)

        def _expired(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._waiting_for_headers():
                self._arm()
                self._header_bytes += len(data)
            super().data_received(data)
            if not self._waiting_for_headers():
                self._header_bytes = 0
                if self._header_timer is not None:
                    self._header_timer.cancel()
                    self._header_timer = None
            elif self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                self.transport.write(_headers_too_large_response())
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return _HeaderTimeout


def h11_protocol(header_timeout: float):
    """uvicorn's h11 protocol (pure Python) with the header timeout (``_guarded``), answering
    requests it cannot parse with our JSON error shape."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class _H11Protocol(_guarded(H11Protocol, header_timeout)):
        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request it cannot parse (bad request line, headers, framing),
            in our JSON error shape instead of plain text."""
            data = _invalid_http_body(msg)
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(data)).encode())]
            try:
                for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=data),
                              h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # the connection's state allows no response: just close
                pass
            self.transport.close()

    return _H11Protocol


def httptools_protocol(header_timeout: float):
    """uvicorn's httptools protocol (llhttp, a C parser: several times less of the event loop's
    time per request than h11) with the header timeout, answering requests it cannot parse with
    our JSON error shape."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _HttpToolsProtocol(_guarded(HttpToolsProtocol, header_timeout)):
        def send_400_response(self, msg: str) -> None:
            data = _invalid_http_body(msg)
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                                 b"content-length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            self.transport.close()

    return _HttpToolsProtocol


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


HTTP_CHOICES = ("auto", "httptools", "h11")
LOOP_CHOICES = ("auto", "uvloop", "asyncio")


def _fast_or_fallback(kind: str, setting: str, choices: tuple, fast: str, fallback: str) -> str:
    """``kind`` among ``choices``: ``auto`` is the C implementation ``fast`` when installed, else
    ``fallback``; naming ``fast`` when it is not installed is a ValueError naming ``setting``."""
    if kind not in choices:
        raise ValueError(f"{setting} must be one of {', '.join(choices)}, got {kind!r}")
    if kind == fast and not _installed(fast):
        raise ValueError(f"{setting} {fast}: the {fast} package is not installed (pip install {fast})")
    if kind == "auto":
        return fast if _installed(fast) else fallback
    return kind


def http_parser(kind: str) -> str:
    """The HTTP/1.1 parser ``kind`` names: ``auto`` is httptools when installed (the default
    install has it), else h11."""
    return _fast_or_fallback(kind, "uvicorn_http", HTTP_CHOICES, "httptools", "h11")


def http_protocol(kind: str, header_timeout: float):
    """The protocol class uvicorn serves with, for the parser ``http_parser(kind)`` picks."""
    if http_parser(kind) == "httptools":
        return httptools_protocol(header_timeout)
    return h11_protocol(header_timeout)


def event_loop(kind: str) -> str:
    """uvicorn's ``loop`` setting: ``auto`` is uvloop when installed (libuv: the loop's own
    scheduling, sockets and transports in C), else asyncio's."""
    return _fast_or_fallback(kind, "uvicorn_loop", LOOP_CHOICES, "uvloop", "asyncio")


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (uvicorn listens on it): a host that does not resolve or a
    port already in use is a ValueError naming it -- before the engine starts loading, so the
    process ends with that one line and a non-zero exit."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} is not an address this machine can listen on ({e})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
