"""ASGI and HTTP-protocol guards in front of the OpenAI app: the API key, request ids and bounded
request bodies (``RequestGuard``). uvicorn's HTTP protocol with a header timeout and JSON errors
for unparseable requests is ``http_guard.http_protocol``. ``api_server.build_app`` wires them."""
from __future__ import annotations

import re
import uuid
from typing import Optional

from fastapi.responses import Response

from pagedllm.entrypoints.http_guard import guard_body
from pagedllm.entrypoints.openai.serving import APIError, internal_error
from pagedllm.entrypoints.request_id import request_id_var

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})


def json_response(model, status: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(content=model.model_dump_json(), status_code=status, media_type="application/json",
                    headers=headers)


def error_response(status: int, message: str, param=None, code=None, type=None, headers=None) -> Response:
    return json_response(APIError(status, message, param, code, type).body(), status, headers)


def _error(status: int, message: str, code: str, headers: Optional[dict[str, str]] = None) -> Response:
    return error_response(status, message, code=code, headers=headers)



_REQUEST_ID_OK = re.compile(r"[!-~]{1,128}")  # visible ASCII, at most 128 characters
_JSON_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                         "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class RequestGuard:
    """Pure ASGI, outermost: gives every request an id (X-Request-Id echoed or generated, set for
    log lines), then ``http_guard.guard_body``: the API key (``state.api_key``; not on the open
    paths) before anything is read, and every request body read by the guard, on every route and
    method -- bounded in size (413) and in the time between chunks (408); JSON only (415) on the
    JSON routes -- before the app parses anything. Streaming responses pass untouched."""

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

        receive = await guard_body(scope, receive, send_with_id, self.state, _error, _JSON_PATHS, OPEN_PATHS)
        if receive is not None:
            await self.app(scope, receive, send_with_id)


class InternalErrors:
    """Pure ASGI, inside the app's exception handlers: an unexpected exception becomes the 500 of
    ``serving.internal_error`` (or a 400 for input nested too deeply to process: RecursionError)
    and is not re-raised, so uvicorn keeps the keep-alive connection open (Starlette's own
    handler for Exception re-raises, and uvicorn then drops the connection). After a response
    has started (a stream) there is nothing to answer: the exception goes on up."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:
                raise
            if isinstance(e, RecursionError):
                resp = error_response(400, "the request nests too deeply to be processed (a JSON value inside it, "
                                           "such as a schema or tool-call arguments)", code="nesting_too_deep")
            else:
                err = internal_error(e)
                resp = json_response(err.body(), err.status)
            await resp(scope, receive, send)
