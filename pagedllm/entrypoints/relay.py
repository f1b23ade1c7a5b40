"""Relaying a backend's answer (an httpx response opened with ``stream=True``) to the client: a
body read whole, or a stream passed on chunk by chunk as it arrives. Used by the data-parallel
router and by the multi-model server."""
from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse

FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "x-request-id", "x-request-timeout", "accept")
FORWARD_RESPONSE_HEADERS = ("retry-after", "x-request-id")


def error_response(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-shaped error answered by the front process itself."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status, headers=headers or None)


def error_event(message: str, code: str) -> bytes:
    """The end of a stream that broke mid-way: an error event, then [DONE]."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def unless_disconnected(raw, coro) -> Response:
    """Run ``coro`` (the request's forwarding); a client that goes away before the answer starts
    cancels it (the backend then sees its connection close and aborts the request)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if task.cancelled() and watcher.done():
            return Response(status_code=499)  # nobody is left to read it
        raise
    finally:
        watcher.cancel()


def request_headers(raw) -> dict[str, str]:
    """The client's headers a backend needs (its key, content type, request id and deadline)."""
    return {k: v for k, v in raw.headers.items() if k.lower() in FORWARD_REQUEST_HEADERS}


def answer_headers(resp, extra: dict[str, str]) -> dict[str, str]:
    return {**{k: v for k, v in resp.headers.items() if k.lower() in FORWARD_RESPONSE_HEADERS}, **extra}


def whole_response(resp, data: bytes, extra: dict[str, str]) -> Response:
    return Response(content=data, status_code=resp.status_code, headers=answer_headers(resp, extra),
                    media_type=resp.headers.get("content-type"))


async def relay(resp, extra: dict[str, str], finish: Callable[[], None],
                broke: Callable[[Exception, bool], Awaitable[tuple[int, str, str]]]) -> Response:
    """The client's answer from ``resp``; ``finish()`` runs once it is read to its end (or failed);
    ``broke(error, mid_stream)`` -> (status, message, code) of what the client gets instead when the
    backend fails while answering (mid-stream: an error event and [DONE])."""
    import httpx

    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            data = await resp.aread()
        except httpx.HTTPError as e:
            status, message, code = await broke(e, False)
            return error_response(status, message, code, headers=extra)
        finally:
            await resp.aclose()
            finish()
        return whole_response(resp, data, extra)

    async def chunks():
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            _, message, code = await broke(e, True)
            yield error_event(message, code)
        finally:
            await resp.aclose()
            finish()

    return StreamingResponse(chunks(), status_code=resp.status_code, headers=answer_headers(resp, extra),
                             media_type=resp.headers.get("content-type"))
