"""The HTTP server's own settings (``ServerArgs``; the engine's are the EngineConfig), the
``--override-generation-config`` parser, and the uvicorn settings of ``pagedllm serve``."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.entrypoints.http_guard import event_loop, http_parser, http_protocol
from pagedllm.entrypoints.openai import lora_modules


@dataclass(frozen=True)
class ServerArgs:
    """The HTTP server's own settings (the engine's are the EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    log_level: str = "info"
    access_log: bool = False
    shutdown_timeout: float = 30.0
    skip_tokenizer_init: bool = False
    trust_request_chat_template: bool = False  # allow chat_template in requests (rendered in a sandbox process)
    chat_template_timeout: float = 2.0  # seconds a request's chat template may render
    chat_template: Optional[str] = None  # a template string or file replacing the model's chat template
    max_request_body_size: Optional[int] = None  # bytes; default 4 MiB above the largest prompt that fits
    http_read_timeout: float = 30.0  # seconds to receive a request's headers, and between body chunks
    request_timeout: Optional[float] = None  # default per-request deadline in seconds (None: none)
    metrics_prefix: str = "pagedllm"  # metric names are PREFIX:name ("vllm" for vLLM's dashboards)
    lora_modules: tuple[str, ...] = ()  # LoRA adapters served from the start: name=path or JSON objects
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: Optional[str] = None  # tool_parsers.TOOL_PARSERS: how "auto" reads the model's tool calls
    enable_dashboard: bool = False  # GET /dashboard: the live engine page (dashboard.py)
    # vLLM's serve flags (docs/usage.md, *vLLM's serve flags*)
    served_model_names: tuple[str, ...] = ()  # every name a request's model may use (the first is reported)
    uvicorn_log_level: Optional[str] = None  # uvicorn's own log level (default: log_level)
    uvicorn_loop: str = "auto"  # the event loop: uvloop when installed (auto), uvloop, asyncio
    uvicorn_http: str = "auto"  # the HTTP/1.1 parser: httptools when installed (auto), httptools, h11
    enable_log_requests: bool = False  # one log line per request (id, prompt length, sampling params)
    disable_log_stats: bool = False  # no periodic stats line
    max_logprobs: int = 20  # the most logprobs / top_logprobs / prompt_logprobs a request may ask for
    allowed_origins: tuple[str, ...] = ()  # CORS: origins a browser may call from (none: no CORS headers)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: Optional[str] = None  # the path prefix a proxy serves this app under
    ssl_keyfile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_ca_certs: Optional[str] = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE; 2 = CERT_REQUIRED (client certificates)
    response_role: str = "assistant"  # the role of chat replies
    disable_fastapi_docs: bool = False  # also no /openapi.json (the /docs pages are never served)
    override_generation_config: Optional[str] = None  # JSON over the model's generation_config.json defaults
    reasoning_parser: Optional[str] = None  # deepseek_r1 | qwen3: reasoning_content apart from content

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("shutdown_timeout", "chat_template_timeout", "http_read_timeout", "request_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if self.max_request_body_size is not None and self.max_request_body_size < 1024:
            raise ValueError(f"max_request_body_size must be >= 1024 bytes, got {self.max_request_body_size}")
        lora_modules.parse_lora_modules(self.lora_modules)  # malformed entries fail at start-up
        if self.tool_call_parser is not None:
            from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser")
        if not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be in 0..20 (20 is the most this server computes), "
                             f"got {self.max_logprobs}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together (TLS needs both)")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file: {path}")
        if self.root_path is not None and self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"root_path must start with '/', got {self.root_path!r}")
        if not self.response_role:
            raise ValueError("response_role must not be empty")
        generation_overrides(self.override_generation_config)  # malformed JSON fails at start-up
        event_loop(self.uvicorn_loop)  # an unknown or missing one fails at start-up
        http_parser(self.uvicorn_http)
        if self.reasoning_parser is not None:
            from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # an unknown name fails at start-up
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ValueError(f"metrics_prefix must be a metric name prefix such as pagedllm or vllm, "
                             f"got {self.metrics_prefix!r}")


_GENERATION_KEYS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "max_tokens"}


def generation_overrides(text: Optional[str]) -> dict[str, Any]:
    """--override-generation-config: a JSON object over the model's generation defaults (vLLM's
    flag; ``max_new_tokens`` is max_tokens); ValueError naming the flag."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"override_generation_config is not valid JSON: {e}") from None
    if not isinstance(value, dict) or set(value) - _GENERATION_KEYS:
        raise ValueError(f"override_generation_config must be a JSON object of {', '.join(sorted(_GENERATION_KEYS))}, "
                         f"got {text!r}")
    if "max_new_tokens" in value:
        value["max_tokens"] = value.pop("max_new_tokens")
    return value


def uvicorn_config(app, args: ServerArgs, **kw):
    """The uvicorn settings of ``pagedllm serve`` (tests use them too)."""
    import uvicorn

    tls = {}
    if args.ssl_certfile is not None:
        tls = dict(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                   ssl_cert_reqs=args.ssl_cert_reqs)
    return uvicorn.Config(
        app, host=args.host, port=args.port, log_level=(args.uvicorn_log_level or args.log_level).lower(),
        access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout + 5, timeout_keep_alive=5,
        loop=event_loop(args.uvicorn_loop), http=http_protocol(args.uvicorn_http, args.http_read_timeout),
        root_path=args.root_path or "", **tls, **kw,
    )

