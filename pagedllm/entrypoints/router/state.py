"""The router's state: its replicas (kept healthy by polling their /health), the proxying of a
request to one of them (the next one when it cannot be reached), the relay of its answer, and
the OpenAI-shaped errors the router answers with itself."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.relay import error_event, relay, request_headers, unless_disconnected, whole_response
from pagedllm.entrypoints.relay import error_response as relay_error

from pagedllm.entrypoints.router.metrics import merge_backend_metrics, router_metrics
from pagedllm.entrypoints.router.replicas import Choice, ReplicaSet

if TYPE_CHECKING:
    from pagedllm.entrypoints.router.args import RouterArgs

logger = logging.getLogger("pagedllm.entrypoints.router.app")

_RETRY_CODES = {"loading", "shutting_down", "engine_dead"}  # a 503 the request never reached an engine for


def error_response(status: int, message: str, code: str, replica: Optional[int] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """An OpenAI-shaped error the router answers itself (naming the replica, if one was tried)."""
    headers = {**(headers or {}), **({"x-pagedllm-replica": str(replica)} if replica is not None else {})}
    return relay_error(status, message, code, headers)


class RouterState:
    """The replicas, their health, and the proxying of one request to one of them."""

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
        return await unless_disconnected(raw, self._proxy(raw, path, body, hashes, count))

    async def _proxy(self, raw: Request, path: str, body: bytes, hashes: list[bytes], count: bool = True) -> Response:
        import httpx

        headers = request_headers(raw)
        tried, dropped = [], 0
        while True:
            choice: Optional[Choice] = self.replicas.choose(hashes, exclude=tried, count=count)
            if choice is None:
                self.no_replica += 1
                detail = "; ".join(f"replica {r.id}: {r.last_error}" for r in tried) or "none is healthy"
                return error_response(503, f"no replica could take the request ({detail}); retry later", "no_replica")
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
                return error_response(502, f"replica {replica.id} closed the connection on this request twice "
                                           f"without answering ({type(e).__name__}), though it is healthy: check "
                                           "the request (its size, say)", "replica_closed", replica.id)
            if resp.status_code == 503:
                try:
                    data = await resp.aread()
                except BaseException:
                    self.replicas.finish(replica)
                    raise
                finally:
                    await resp.aclose()
                code = error_code(data)
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
        return whole_response(resp, data, {"x-pagedllm-replica": str(replica_id)})

    async def _relay(self, resp, replica) -> Response:
        async def broke(e: Exception, mid_stream: bool) -> tuple[int, str, str]:
            self.proxy_errors += 1
            where = "mid-stream" if mid_stream else "mid-answer"
            await self._fault(replica, f"{type(e).__name__} {where}: {e}")
            return 502, f"replica {replica.id} failed {'mid-stream' if mid_stream else 'while answering'}: {e}", \
                "replica_failed"

        return await relay(resp, {"x-pagedllm-replica": str(replica.id)}, lambda: self.replicas.finish(replica), broke)

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


def error_code(data: bytes) -> Optional[str]:
    try:
        return json.loads(data)["error"]["code"]
    except Exception:
        return None
