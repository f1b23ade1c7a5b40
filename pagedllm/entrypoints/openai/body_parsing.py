"""Large request bodies are parsed off the event loop (issue 29).

FastAPI decodes a route's JSON body and validates it against the route's model on the event
loop; a 4 MB body (a 200k-key ``logit_bias``, a long message list) then holds up every other
request on the loop, /health included, for as long as that takes. ``OffLoopBodyRoute`` (the
app's route class) does both steps on a small pool of its own for a body of at least
``INLINE_BODY_BYTES``, with FastAPI's own decoder and field validator, so the errors are the
ones FastAPI would raise (``json_invalid``, the model's errors under ``body``, a 400 "There was
an error parsing the body" for anything else json.loads refuses); it hands FastAPI the
validated model, which FastAPI accepts as is (pydantic does not revalidate an instance of the
model). Smaller bodies are parsed by FastAPI on the loop (a thread hop costs more than they do).
The pool is bounded (``PARSE_WORKERS`` threads; more bodies wait for one), never the default
executor that tokenization and template rendering use.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

INLINE_BODY_BYTES = 64 << 10
PARSE_WORKERS = 2
_pool: Optional[ThreadPoolExecutor] = None


def _parse_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="pagedllm-body")
    return _pool


def decode_and_validate(body: bytes, field) -> Any:
    """FastAPI's body handling for one JSON body and the route's body field (on any thread)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from e
    except Exception as e:  # e.g. bytes that are not UTF-8, or nesting too deep for the decoder
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
    value, errors = field.validate(obj, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=obj)
    return value


def _json_content(content_type: Optional[str]) -> bool:
    """Whether FastAPI decodes this body as JSON (no Content-Type, or application/json or +json)."""
    if not content_type:
        return True
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class OffLoopBodyRoute(APIRoute):
    """An APIRoute whose large JSON bodies are decoded and validated on the parse pool."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        field = self.body_field
        if field is None or self._embed_body_fields:  # no body, or several body parameters: FastAPI's way
            return handler

        async def parse_off_the_loop(request: Request):
            body = await request.body()
            if len(body) >= INLINE_BODY_BYTES and _json_content(request.headers.get("content-type")):
                loop = asyncio.get_running_loop()
                # Starlette's Request.json() returns this; FastAPI then only checks the instance
                request._json = await loop.run_in_executor(_parse_pool(), decode_and_validate, body, field)
            return await handler(request)

        return parse_off_the_loop
