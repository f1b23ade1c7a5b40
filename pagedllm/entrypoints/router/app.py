"""The router's FastAPI app: OpenAI requests proxied to one replica each.

/v1/completions and /v1/chat/completions are routed (replicas.ReplicaSet.choose) by the prompt's
block hash chain; /tokenize and /detokenize by load; /v1/models comes from a healthy backend;
/health is 200 while at least one replica is; /metrics merges the backends' and adds the
router's own. Streams pass through unbuffered (each chunk is forwarded as it arrives). A replica
that cannot be reached (connect error, or a 503 saying it is loading, draining or dead) is taken
out and the request goes to the next one. A replica that was reached but dropped the connection
(before or while answering) is taken out only if its /health then fails too: a client's bad
request (a body the replica refuses with 413 and closes on, say) never takes a replica out --
that request alone ends with a 502 (or, mid-stream, an OpenAI error event and [DONE]); a 4xx is
relayed as it is. Before anything is read or forwarded, ``http_guard.guard_body`` checks the
router's API key (``--api-key``; the replicas check theirs too: the Authorization header is
passed through) and reads the body bounded in size (413) and time between chunks (408), on
every route. Each answer names its replica in the ``x-pagedllm-replica`` header.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Optional

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.http_guard import guard_body
from pagedllm.entrypoints.router.args import RouterArgs  # noqa: F401 (re-exported)
from pagedllm.entrypoints.router.routes import http_error, router
from pagedllm.entrypoints.router.state import RouterState, error_response

__all__ = ["RouterArgs", "RouterGuard", "RouterState", "build_router_app"]

_JSON_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
_OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


def _guard_error(status: int, message: str, code: str, headers: Optional[dict[str, str]] = None):
    return error_response(status, message, code, headers=headers)


class RouterGuard:
    """Pure ASGI, outermost: ``http_guard.guard_body`` (the API key, then the bounded body)."""

    def __init__(self, app, state: RouterState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        receive = await guard_body(scope, receive, send, self.state, _guard_error, _JSON_PATHS, _OPEN_PATHS)
        if receive is not None:
            await self.app(scope, receive, send)


def _lifespan(transport):
    """The app's lifespan: the client to the replicas (over ``transport``, if given), their first
    health checks and the poller that keeps checking them."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        import httpx

        state: RouterState = app.state.router
        args = state.args
        timeout = httpx.Timeout(connect=args.connect_timeout_s, read=None, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        state.client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)
        await asyncio.gather(*(state.check(r) for r in state.replicas.replicas))
        poller = asyncio.create_task(state.poll_health())
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            await state.client.aclose()

    return lifespan


def build_router_app(args: RouterArgs, hasher=None, transport=None) -> FastAPI:
    """``hasher``/``transport``: a PromptHasher and an httpx transport to use instead of loading
    the tokenizer and opening sockets (tests)."""
    state = RouterState(args, hasher)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request and health poll
    app = FastAPI(title="pagedllm router", lifespan=_lifespan(transport))
    app.state.router = state
    app.add_middleware(RouterGuard, state=state)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.include_router(router)
    return app
