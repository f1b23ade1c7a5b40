"""The errors a client sees, ``{"error": {message, type, param, code}}`` with an HTTP status, and
how any exception on the way from a request to the engine and back becomes one: a refusal the
client caused (400 naming the field), a full queue or compile pool (429, Retry-After), a dead
engine (503, without internals), a deadline (408), else a 500 that names only the request id."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from pagedllm.engine.async_llm import DEAD_MESSAGE, EngineDeadError, QueueFullError, RequestFailedError
from pagedllm.entrypoints.openai.protocol_base import ErrorInfo, ErrorResponse
from pagedllm.entrypoints.request_id import request_id_var
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.limits import CompilePoolFullError, CompileTimeoutError

logger = logging.getLogger("pagedllm.server")

_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}
_DEFAULT_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                  408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type",
                  429: "queue_full", 500: "internal_error", 503: "unavailable"}


class APIError(Exception):
    """An error the client sees as ``{"error": {message, type, param, code}}`` with ``status``
    (and ``headers``, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or _DEFAULT_CODES.get(status, "error")
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str) -> APIError:
    """A 400 for a bad value of the request field ``param``."""
    return APIError(400, message, param=param, code="invalid_value")


def to_api_error(e: BaseException, aliases: Optional[dict[str, str]] = None) -> APIError:
    """The client's view of ``e``; a ValueError whose first word is a SamplingParams field names
    that field (``aliases``: the request's name for it, e.g. max_completion_tokens)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):  # its text may hold internals (paths, ports, exceptions): logged only
        logger.error("engine dead: %s", e)
        return APIError(503, DEAD_MESSAGE, code="engine_dead")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="request_failed")
    if isinstance(e, CompileTimeoutError):
        return APIError(408, str(e), code="compile_timeout")
    if isinstance(e, CompilePoolFullError):
        return APIError(429, str(e), code="compile_queue_full", headers={"Retry-After": "1"})
    if isinstance(e, (ValueError, TypeError)):
        first = str(e).split(" ", 1)[0]
        param = (aliases or {}).get(first, first) if first in _PARAM_NAMES else None
        return APIError(400, str(e), param=param, code="invalid_value")
    return internal_error(e)


def internal_error(e: BaseException) -> APIError:
    """A 500 without internal details: the request id, with the traceback in the server log."""
    rid = request_id_var.get()
    logger.error("internal error (request id %s)", rid, exc_info=e)
    return APIError(500, f"internal server error; the server log has the details under request id {rid}",
                    code="internal_error", type="server_error")


class RequestTimeout(APIError):
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request did not finish within its timeout of {seconds:g} s and was aborted "
                              "(set 'timeout' in the body or the x-request-timeout header to allow more)",
                         param="timeout", code="request_timeout")


class ShuttingDown(APIError):
    def __init__(self) -> None:
        super().__init__(503, "the server is shutting down and ended this request; retry on another replica",
                         code="shutting_down")


def sse(model) -> str:
    """One server-sent event holding ``model``'s JSON."""
    return f"data: {model.model_dump_json()}\n\n"
