"""ASGI and HTTP-protocol guards in front of the OpenAI app: the API key, request ids and bounded
request bodies (``RequestGuard``), and uvicorn's h11 protocol with a header timeout and JSON
errors for unparseable requests (``h11_protocol``). ``api_server.build_app`` wires them."""
from __future__ import annotations

import asyncio
import re
import secrets
import uuid
from typing import Optional

from fastapi.responses import Response

from pagedllm.entrypoints.openai.serving import APIError
from pagedllm.entrypoints.request_id import request_id_var

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})


def json_response(model, status: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(content=model.model_dump_json(), status_code=status, media_type="application/json",
                    headers=headers)


def error_response(status: int, message: str, param=None, code=None, type=None, headers=None) -> Response:
    return json_response(APIError(status, message, param, code, type).body(), status, headers)


class AuthMiddleware:
    """Bearer API key on everything but the open paths (pure ASGI: streaming is untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self._key):
                resp = error_response(401, "Incorrect or missing API key: pass 'Authorization: Bearer <key>'.",
                              code="invalid_api_key")
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


_REQUEST_ID_OK = re.compile(r"[!-~]{1,128}")  # visible ASCII, at most 128 characters
_JSON_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})


class RequestGuard:
    """Pure ASGI, outermost: gives every request an id (X-Request-Id echoed or generated, set for
    log lines), refuses a new request while shutting down, and reads POST bodies itself --
    bounded in size (413) and in the time between chunks (408), JSON only (415) -- before the
    app sees them. Streaming responses pass untouched."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID_OK.fullmatch(given) else uuid.uuid4().hex
        request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        if scope["method"] == "POST" and scope["path"] in _JSON_PATHS:
            ctype = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            if ctype and ctype != "application/json" and not ctype.endswith("+json"):
                return await error_response(415, f"the Content-Type must be application/json, got {ctype!r}",
                                    code="unsupported_media_type")(scope, receive, send_with_id)
            limit = self.state.max_body_size
            try:
                declared = int(headers.get(b"content-length", b"-1"))
            except ValueError:
                declared = -1
            if declared > limit:
                return await self._too_large(declared, limit, scope, receive, send_with_id)
            chunks, size, timeout = [], 0, self.state.args.http_read_timeout
            while True:
                try:
                    message = await asyncio.wait_for(receive(), timeout)
                except asyncio.TimeoutError:
                    return await error_response(408, f"the request body was not received: nothing arrived for {timeout:g} s",
                                        code="body_timeout")(scope, receive, send_with_id)
                if message["type"] == "http.disconnect":
                    return
                body = message.get("body", b"")
                size += len(body)
                if size > limit:
                    return await self._too_large(size, limit, scope, receive, send_with_id)
                chunks.append(body)
                if not message.get("more_body", False):
                    break
            replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

            async def receive_replayed():
                return replay.pop() if replay else await receive()

            return await self.app(scope, receive_replayed, send_with_id)
        return await self.app(scope, receive, send_with_id)

    @staticmethod
    async def _too_large(size: int, limit: int, scope, receive, send):
        resp = error_response(413, f"the request body is {'at least ' if size <= limit else ''}{size} bytes; this server "
                           f"accepts at most {limit} (--max-request-body-size)", code="request_too_large",
                      headers={"Connection": "close"})
        await resp(scope, receive, send)


def h11_protocol(header_timeout: float):
    """uvicorn's h11 protocol, closing a connection that does not deliver a request's headers
    within ``header_timeout`` seconds of connecting or of sending its first bytes after the
    previous response (idle keep-alive connections are uvicorn's timeout_keep_alive), and
    answering requests it cannot parse with our JSON error shape."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class _H11Protocol(H11Protocol):
        _header_timer = None

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
            super().data_received(data)
            if not self._waiting_for_headers() and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request it cannot parse (bad request line, headers, framing),
            in our JSON error shape instead of plain text."""
            import h11

            body = APIError(400, f"invalid HTTP request: {msg.rstrip('.')}", code="invalid_http").body()
            data = body.model_dump_json().encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(data)).encode())]
            try:
                for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=data),
                              h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # the connection's state allows no response: just close
                pass
            self.transport.close()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return _H11Protocol
