"""The app's exception handlers: every error an OpenAI-shaped JSON body with a non-null ``code``
(an APIError as raised; a request that fails validation a 400 naming the field; a 404 or 405
naming the route). ``add_error_handlers(app)`` registers them."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai.middleware import error_response, json_response
from pagedllm.entrypoints.openai.serving import APIError


async def api_error(request: Request, exc: APIError):
    return json_response(exc.body(), exc.status, exc.headers)


def _where(error: dict) -> str:
    """A validation error's location in the body (``messages.0.content``)."""
    return ".".join(str(x) for x in error.get("loc", ()) if x != "body")


async def validation_error(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_response(400, f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    if tuple(first.get("loc", ())) == ("body",):
        if first.get("type") == "missing":
            return error_response(400, "the request body is empty: send a JSON object", code="empty_body")
        return error_response(400, "the request body must be a JSON object", code="invalid_json")
    extra = [_where(e) for e in errors if e.get("type") == "extra_forbidden"]
    if extra:
        return error_response(400, f"unsupported field{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}: "
                              "this server does not implement it (remove it from the request)",
                              extra[0], "unsupported_field")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    code = "invalid_type" if first.get("type") != "value_error" else "invalid_value"
    parts = []
    for e in errors[:4]:
        where = _where(e)
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return error_response(400, "invalid request: " + "; ".join(parts), loc[0] if loc else None, code)


async def http_error(request: Request, exc: StarletteHTTPException):
    message = str(exc.detail)
    if exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
        if exc.headers and exc.headers.get("Allow"):
            message += f"; allowed: {exc.headers['Allow']}"
    elif exc.status_code == 404:
        message = f"no such route: {request.method} {request.url.path}"
    return error_response(exc.status_code, message, headers=exc.headers)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
