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
import json
import logging
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.http_guard import guard_body
from pagedllm.entrypoints.router.metrics import CONTENT_TYPE, merge_backend_metrics, router_metrics
from pagedllm.entrypoints.router.replicas import POLICIES, Choice, ReplicaSet

logger = logging.getLogger(__name__)

_FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "x-request-id", "x-request-timeout", "accept")
_FORWARD_RESPONSE_HEADERS = ("retry-after", "x-request-id")
_JSON_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
_OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
_RETRY_CODES = {"loading", "shutting_down", "engine_dead"}  # a 503 the request never reached an engine for


@dataclass(frozen=True)
class RouterArgs:
    backends: tuple[str, ...]
    model: Optional[str] = None  # tokenizer directory (the served model's); None: no prefix routing
    tokenizer: Optional[str] = None  # overrides model for the tokenizer files
    served_model_names: tuple[str, ...] = ()  # base-model names (requests naming others are keyed apart)
    block_size: int = 16  # must equal the replicas' --block-size
    policy: str = "prefix"
    index_capacity_blocks: int = 1 << 16  # per replica; set near the replicas' KV cache block count
    max_load_imbalance: int = 8
    min_prefix_ratio: float = 0.5
    health_interval_s: float = 2.0
    retry_min_s: float = 1.0
    retry_max_s: float = 30.0
    connect_timeout_s: float = 5.0
    max_request_body_size: int = 64 << 20
    http_read_timeout: float = 30.0  # seconds to receive a request's headers, and between body chunks
    api_key: Optional[str] = None  # checked here before a body is read (None: only the replicas check)
    chat_template: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("router: --backends needs at least one URL")
        if self.policy not in POLICIES:
            raise ValueError(f"router: --routing must be one of {POLICIES}, got {self.policy!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"router: --block-size must be a power of two, got {self.block_size}")
        if self.index_capacity_blocks < 1:
            raise ValueError(f"router: --index-capacity-blocks must be >= 1, got {self.index_capacity_blocks}")
        if self.health_interval_s <= 0 or self.retry_min_s <= 0 or self.retry_max_s < self.retry_min_s:
            raise ValueError("router: need health_interval_s > 0 and 0 < retry_min_s <= retry_max_s")
        if self.max_request_body_size < 1 or not self.http_read_timeout > 0:
            raise ValueError("router: need max_request_body_size >= 1 byte and http_read_timeout > 0")


def _error(status: int, message: str, code: str, replica: Optional[int] = None,
           headers: Optional[dict[str, str]] = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    headers = {**(headers or {}), **({"x-pagedllm-replica": str(replica)} if replica is not None else {})} or None
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status, headers=headers)


def _error_event(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def _guard_error(status: int, message: str, code: str, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return _error(status, message, code, headers=headers)


class RouterGuard:
    """Pure ASGI, outermost: ``http_guard.guard_body`` (the API key, then the bounded body)."""

    def __init__(self, app, state: "RouterState") -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        receive = await guard_body(scope, receive, send, self.state, _guard_error, _JSON_PATHS, _OPEN_PATHS)
        if receive is not None:
            await self.app(scope, receive, send)


class RouterState:
    def __init__(self, args: RouterArgs, hasher=None) -> None:
        self.args = args
        self.api_key, self.max_body_size, self.http_read_timeout = (args.api_key, args.max_request_body_size,
                                                                    args.http_read_timeout)
        self.replicas = ReplicaSet(args.backends, args.policy, args.index_capacity_blocks, args.max_load_imbalance,
                                   args.retry_min_s, args.retry_max_s, args.min_prefix_ratio)
        self.hasher = hasher if hasher is not None else self._load_hasher()
        self.client = None  # httpx.AsyncClient, made in the app's lifespan (tests may pass a transport)
        self.no_replica = 0
        self.proxy_errors = 0

    def _load_hasher(self):
        if self.args.model is None and self.args.tokenizer is None or self.args.policy == "round_robin":
            return None
        from pagedllm.entrypoints.router.prompt_hashes import PromptHasher
        from pagedllm.tokenizer.tokenizer import load_tokenizer

        template = None
        if self.args.chat_template is not None:
            from pagedllm.tokenizer.chat_template import load_chat_template

            template = load_chat_template(self.args.chat_template)
        names = set(self.args.served_model_names)
        if self.args.model:
            names |= {self.args.model, self.args.model.rstrip("/").rsplit("/", 1)[-1]}
        try:
            tokenizer = load_tokenizer(self.args.tokenizer or self.args.model)
        except ValueError as e:  # e.g. a checkpoint served with --skip-tokenizer-init
            logger.warning("router: no tokenizer (%s); only token-id prompts are routed by prefix", e)
            tokenizer = None
        return PromptHasher(tokenizer, self.args.block_size, names, template)

    # ---- health -------------------------------------------------------------------------------
    async def check(self, replica) -> None:
        import httpx

        try:
            resp = await self.client.get(f"{replica.url}/health", timeout=self.args.connect_timeout_s)
        except httpx.HTTPError as e:
            self._down(replica, f"/health: {type(e).__name__}: {e}")
            return
        if resp.status_code == 200:
            if not replica.healthy:
                logger.info("replica %d (%s) is up", replica.id, replica.url)
            self.replicas.mark_up(replica)
        else:
            self._down(replica, f"/health answered {resp.status_code}")

    async def _fault(self, replica, why: str) -> bool:
        """A replica dropped a connection it had accepted: take it out (True) only if its
        /health fails now too; a healthy one closed on that request (e.g. a body it refused)."""
        import httpx

        try:
            resp = await self.client.get(f"{replica.url}/health", timeout=self.args.connect_timeout_s)
            if resp.status_code == 200:
                logger.info("replica %d dropped a request (%s) and is healthy: kept", replica.id, why)
                return False
            why += f"; /health answered {resp.status_code}"
        except httpx.HTTPError as e:
            why += f"; /health: {type(e).__name__}"
        self._down(replica, why)
        return True

    def _down(self, replica, why: str) -> None:
        if replica.healthy:
            logger.warning("replica %d (%s) taken out: %s", replica.id, replica.url, why)
        self.replicas.mark_down(replica, why)

    async def poll_health(self) -> None:
        while True:
            due = self.replicas.due_for_check(self.args.health_interval_s)
            if due:
                await asyncio.gather(*(self.check(r) for r in due))
            await asyncio.sleep(min(self.args.health_interval_s, self.args.retry_min_s) / 2)

    # ---- proxying -----------------------------------------------------------------------------
    async def proxy(self, raw: Request, path: str, body: bytes, hashes: list[bytes], count: bool = True) -> Response:
        """Forward to a replica; a client that goes away before the answer starts cancels it (the
        replica sees its connection close and aborts the request)."""
        task = asyncio.ensure_future(self._proxy(raw, path, body, hashes, count))

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

    async def _proxy(self, raw: Request, path: str, body: bytes, hashes: list[bytes], count: bool = True) -> Response:
        import httpx

        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARD_REQUEST_HEADERS}
        tried, dropped = [], 0
        while True:
            choice: Optional[Choice] = self.replicas.choose(hashes, exclude=tried, count=count)
            if choice is None:
                self.no_replica += 1
                detail = "; ".join(f"replica {r.id}: {r.last_error}" for r in tried) or "none is healthy"
                return _error(503, f"no replica could take the request ({detail}); retry later", "no_replica")
            replica = choice.replica
            try:
                req = self.client.build_request(raw.method, replica.url + path, content=body, headers=headers,
                                                params=raw.query_params)
                resp = await self.client.send(req, stream=True)
            except asyncio.CancelledError:
                self.replicas.finish(replica)
                raise
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # not reached: try the next replica
                self.replicas.finish(replica)
                self._down(replica, f"{type(e).__name__}: {e}")
                tried.append(replica)
                continue
            except httpx.TransportError as e:  # reached, and the connection dropped before an answer
                self.replicas.finish(replica)
                if await self._fault(replica, f"{type(e).__name__}: {e}"):
                    tried.append(replica)
                    continue
                dropped += 1
                if dropped == 1:  # a stale kept-alive connection, perhaps: once more (a fresh one)
                    continue
                self.proxy_errors += 1
                return _error(502, f"replica {replica.id} closed the connection on this request twice without "
                                   f"answering ({type(e).__name__}), though it is healthy: check the request "
                                   "(its size, say)", "replica_closed", replica.id)
            if resp.status_code == 503:
                try:
                    data = await resp.aread()
                except BaseException:
                    self.replicas.finish(replica)
                    raise
                finally:
                    await resp.aclose()
                code = _error_code(data)
                if code in _RETRY_CODES:
                    self.replicas.finish(replica)
                    self._down(replica, f"answered 503 {code}")
                    tried.append(replica)
                    continue
                self.replicas.finish(replica)
                return self._response(resp, data, replica.id)
            return await self._relay(resp, replica)

    @staticmethod
    def _response(resp, data: bytes, replica_id: int) -> Response:
        headers = {k: v for k, v in resp.headers.items() if k.lower() in _FORWARD_RESPONSE_HEADERS}
        headers["x-pagedllm-replica"] = str(replica_id)
        return Response(content=data, status_code=resp.status_code, headers=headers,
                        media_type=resp.headers.get("content-type"))

    async def _relay(self, resp, replica) -> Response:
        import httpx

        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                data = await resp.aread()
            except httpx.HTTPError as e:
                self.proxy_errors += 1
                await self._fault(replica, f"{type(e).__name__} mid-answer: {e}")
                return _error(502, f"replica {replica.id} failed while answering: {e}", "replica_failed", replica.id)
            finally:
                await resp.aclose()
                self.replicas.finish(replica)
            return self._response(resp, data, replica.id)

        async def chunks():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                self.proxy_errors += 1
                await self._fault(replica, f"{type(e).__name__} mid-stream: {e}")
                yield _error_event(f"replica {replica.id} failed mid-stream: {e}", "replica_failed")
            finally:
                await resp.aclose()
                self.replicas.finish(replica)

        headers = {k: v for k, v in resp.headers.items() if k.lower() in _FORWARD_RESPONSE_HEADERS}
        headers["x-pagedllm-replica"] = str(replica.id)
        return StreamingResponse(chunks(), status_code=resp.status_code, headers=headers,
                                 media_type=resp.headers.get("content-type"))

    async def gather_metrics(self) -> str:
        async def one(r) -> Optional[str]:
            if not r.healthy:
                return None
            try:
                resp = await self.client.get(f"{r.url}/metrics", timeout=self.args.connect_timeout_s)
                return resp.text if resp.status_code == 200 else None
            except Exception:
                return None

        texts = await asyncio.gather(*(one(r) for r in self.replicas.replicas))
        return merge_backend_metrics(texts) + router_metrics(self.replicas.replicas, self.no_replica,
                                                             self.proxy_errors)


def _error_code(data: bytes) -> Optional[str]:
    try:
        return json.loads(data)["error"]["code"]
    except Exception:
        return None


def build_router_app(args: RouterArgs, hasher=None, transport=None) -> FastAPI:
    """``hasher``/``transport``: a PromptHasher and an httpx transport to use instead of loading
    the tokenizer and opening sockets (tests)."""
    state = RouterState(args, hasher)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        import httpx

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

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request and health poll
    app = FastAPI(title="pagedllm router", lifespan=lifespan)
    app.state.router = state
    app.add_middleware(RouterGuard, state=state)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # 404, 405: OpenAI-shaped
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"no such route: {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                          str(exc.detail))
        return _error(exc.status_code, message, codes.get(exc.status_code, "error"), headers=exc.headers)

    def block_hashes(path: str, body: bytes) -> list[bytes]:
        try:
            parsed: Any = json.loads(body)
        except (ValueError, RecursionError):  # the replica answers it with its 400
            return []
        return state.hasher.block_hashes(path, parsed) if isinstance(parsed, dict) else []

    async def routed(raw: Request, path: str) -> Response:
        body = await raw.body()  # read (bounded) by RouterGuard
        hashes: list[bytes] = []
        if state.hasher is not None and state.replicas.policy != "round_robin":
            hashes = await asyncio.to_thread(block_hashes, path, body)
        return await state.proxy(raw, path, body, hashes)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await routed(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await routed(raw, "/v1/chat/completions")

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await state.proxy(raw, "/tokenize", await raw.body(), [], count=False)

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await state.proxy(raw, "/detokenize", await raw.body(), [], count=False)

    @app.get("/v1/models")
    async def models(raw: Request):
        return await state.proxy(raw, "/v1/models", b"", [], count=False)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        up = state.replicas.healthy()
        if up:
            return Response(status_code=200)
        return _error(503, "no replica is healthy: " + "; ".join(f"replica {r.id} ({r.url}): {r.last_error}"
                                                                 for r in state.replicas.replicas), "no_replica")

    @app.get("/version")
    async def version():
        from pagedllm.version import __version__

        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics():
        return Response(content=await state.gather_metrics(), media_type=CONTENT_TYPE)

    return app
