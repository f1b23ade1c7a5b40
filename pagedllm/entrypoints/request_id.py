"""The id of the HTTP request being served: X-Request-Id (the client's, or generated), in a
context variable the server's middleware sets; log lines show it through RequestIdFilter."""
from __future__ import annotations

import contextvars
import logging

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (``-`` outside a request) for formats naming ``%(request_id)s``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True
