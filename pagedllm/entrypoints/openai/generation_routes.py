"""The generation routes: /v1/completions, /v1/chat/completions and /v1/responses (with its
stored responses: retrieve, delete, cancel, input items).

A client that disconnects before its answer is ready aborts its engine requests (499); a stream
always runs its ``on_close`` (the engine requests aborted), however it ends. The
``x-request-timeout`` header is a request's deadline in seconds."""
from __future__ import annotations

import asyncio
from typing import Callable, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai.body_parsing import OffLoopBodyRoute
from pagedllm.entrypoints.openai.middleware import json_response
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.responses_protocol import DeletedResponse, InputItemList, ResponsesRequest
from pagedllm.entrypoints.openai.server_state import ServerState, current_server
from pagedllm.entrypoints.openai.serving import APIError

router = APIRouter(route_class=OffLoopBodyRoute)


class _SSEResponse(StreamingResponse):
    """A streaming response that always runs ``on_close`` (abort the engine requests), however
    the stream ends: finished, client gone, or cancelled at shutdown."""

    def __init__(self, content, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


_DISCONNECTED = object()


async def _unless_disconnected(raw: Request, coro):
    """Run ``coro``; if the client goes away first, cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> bool:
        while True:
            if (await raw.receive())["type"] == "http.disconnect":
                task.cancel()
                return True

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled() and watcher.result():
            return _DISCONNECTED
        raise
    finally:
        watcher.cancel()


def _timeout(raw: Request) -> Optional[float]:
    value = raw.headers.get("x-request-timeout")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise APIError(400, f"the x-request-timeout header must be a positive number of seconds, got {value!r}",
                       param="timeout", code="invalid_value")
    return seconds


async def _generate(raw: Request, make):
    result = await _unless_disconnected(raw, make())
    if result is _DISCONNECTED:
        return Response(status_code=499)
    if isinstance(result, tuple):  # (streams, SSE generator)
        streams, body = result
        return _SSEResponse(body, on_close=streams.close)
    return json_response(result)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request, state: ServerState = Depends(current_server)):
    serving = state.require()
    timeout = _timeout(raw)
    return await _generate(raw, lambda: serving.create_completion(req, timeout))


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, raw: Request, state: ServerState = Depends(current_server)):
    serving = state.require()
    timeout = _timeout(raw)
    return await _generate(raw, lambda: serving.create_chat_completion(req, timeout))


@router.post("/v1/responses")
async def responses(req: ResponsesRequest, raw: Request, state: ServerState = Depends(current_server)):
    state.require()
    timeout = _timeout(raw)
    return await _generate(raw, lambda: state.responses.create(req, timeout))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, state: ServerState = Depends(current_server)):
    state.require()
    return json_response(state.responses.retrieve(response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: ServerState = Depends(current_server)):
    state.require()
    state.responses.delete(response_id)
    return json_response(DeletedResponse(id=response_id))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, state: ServerState = Depends(current_server)):
    state.require()
    return json_response(await state.responses.cancel(response_id))


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(response_id: str, state: ServerState = Depends(current_server)):
    state.require()
    items = state.responses.input_items(response_id)
    return json_response(InputItemList(data=items, first_id=None, last_id=None))
