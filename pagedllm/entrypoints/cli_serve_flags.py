"""The flags of ``pagedllm serve`` (the HTTP server's, vLLM's serve flags, the data-parallel
router's and the engine's) and the ServerArgs read back from them."""
from __future__ import annotations

import argparse
import json

from pagedllm import envs
from pagedllm.entrypoints.cli_engine_flags import add_engine_args, parse_size
from pagedllm.entrypoints.http_guard import HTTP_CHOICES, LOOP_CHOICES


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's parser on ``sub`` (the ``pagedllm`` parser's subparsers)."""
    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_server_flags(srv)
    _add_request_flags(srv)
    _add_vllm_serve_flags(srv)
    srv.add_argument("--data-parallel-size", type=int, default=1,
                     help="engine replicas behind this server: N child servers on internal ports, each pinned to "
                          "its share of the CPUs (or its own GPUs), and a prefix-aware router on --port")
    from pagedllm.entrypoints.router.server import add_router_args

    add_router_args(srv)
    _add_multi_model_flags(srv)
    add_engine_args(srv, exclude=("served_model_name",))  # several names: _add_vllm_serve_flags
    return srv


def _add_multi_model_flags(srv: argparse.ArgumentParser) -> None:
    """Several models behind one server (docs/usage.md, *Several models in one server*)."""
    g = srv.add_argument_group("several models")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every checkpoint folder (with a config.json) and .gguf file in DIR, each named by "
                        "its folder or file name")
    g.add_argument("--models-config", default=None, metavar="FILE",
                   help="a YAML or JSON file listing models with their names and serve options "
                        "(models: [{model: PATH, name: NAME, pin: true, options: {max_model_len: 1024}}])")
    g.add_argument("--models-memory", type=parse_size, default=None, metavar="SIZE",
                   help="memory the loaded models may hold together (weights, KV caches, their processes); a model "
                        "that does not fit unloads the least recently used idle ones (default: 80%% of what this "
                        "machine or its cgroup has available)")
    g.add_argument("--model-idle-timeout", type=float, default=None, metavar="SECONDS",
                   help="unload a model after this many seconds without requests (default: never)")
    g.add_argument("--pin-model", action="append", default=None, metavar="NAME",
                   help="keep this model loaded from start-up on, never unloaded (may be given more than once)")
    g.add_argument("--model-load-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="longest a model may take to load, and the longest a request without a deadline waits "
                        "for its model (default 300)")


def _add_server_flags(srv: argparse.ArgumentParser) -> None:
    """The model, where to listen, the API key, logging, shutdown and chat templates."""
    srv.add_argument("model_pos", metavar="MODEL", nargs="?", default=None,
                     help="model directory (default: the embedded tiny-shakespeare)")
    srv.add_argument("--model", default=None, action="append",
                     help="model directory or .gguf file (same as MODEL); given more than once, one server serves "
                          "them all, each loaded on its first request (see --models-memory)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (env PAGEDLLM_API_KEY)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False)
    srv.add_argument("--skip-tokenizer-init", action="store_true",
                     help="serve a checkpoint without tokenizer files: token-id prompts only, no text in outputs")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds to let in-flight requests finish; then each open one ends with an "
                          "error (an error event and [DONE] for streams)")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="allow a chat_template in requests (rendered in a separate process, bounded in time, "
                          "memory and output); off by default: such requests get 400")
    srv.add_argument("--chat-template", default=None,
                     help="a chat template (a file, or the template itself) replacing the model's; requests may "
                          "pass variables to it in chat_template_kwargs")
    srv.add_argument("--chat-template-timeout", type=float, default=2.0,
                     help="seconds a request's chat template may take to render (default 2)")


def _add_request_flags(srv: argparse.ArgumentParser) -> None:
    """Per-request bounds, metrics, LoRA adapters, tool calls and the dashboard."""
    srv.add_argument("--max-request-body-size", type=parse_size, default=None,
                     help="largest request body, in bytes or with a unit (8MiB); larger ones get 413 (default: "
                          "4 MiB above the largest prompt max_model_len can hold)")
    srv.add_argument("--http-read-timeout", type=float, default=30.0,
                     help="seconds a client may take to send a request's headers, and between parts of its body "
                          "(then the connection is closed, or 408); default 30")
    srv.add_argument("--request-timeout", type=float, default=None,
                     help="default deadline of a request in seconds (a request's 'timeout' field or x-request-timeout "
                          "header overrides it); past it the request is aborted with 408 (default: none)")
    srv.add_argument("--metrics-prefix", default="pagedllm",
                     help="prefix of the /metrics names (PREFIX:num_requests_running ...); 'vllm' makes vLLM's "
                          "dashboards work unchanged")
    srv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                     help="LoRA adapters to serve (needs --enable-lora): name=path, or a JSON object "
                          '{"name": ..., "path": ..., "base_model_name": ...}; a request\'s model picks one')
    srv.add_argument("--allow-runtime-lora-updating", action="store_true",
                     help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='allow tool_choice "auto" (the default when a request has tools); needs --tool-call-parser')
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    srv.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                     help="how tool_choice \"auto\" reads tool calls out of the model's output")
    srv.add_argument("--enable-dashboard", action="store_true",
                     help="serve GET /dashboard: a live page of the running/waiting requests, the KV cache's block "
                          "map and the step times (behind --api-key: a browser gives the key as the password)")


def _add_vllm_serve_flags(srv: argparse.ArgumentParser) -> None:
    """vLLM's serve flags (docs/usage.md, *vLLM's serve flags*)."""
    g = srv.add_argument_group("vLLM-compatible")
    g.add_argument("--served-model-name", dest="served_model_name", nargs="+", default=None, metavar="NAME",
                   help="the model names requests may use (all routable; the first is the one reported)")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's own log level")
    g.add_argument("--uvicorn-loop", default="auto", choices=list(LOOP_CHOICES),
                   help="the event loop: auto = uvloop when installed (the default install has it), else asyncio")
    g.add_argument("--uvicorn-http", default="auto", choices=list(HTTP_CHOICES),
                   help="the HTTP/1.1 parser: auto = httptools when installed (the default install has it), else h11")
    g.add_argument("--enable-log-requests", action="store_true", help="log one line per request (id, prompt "
                   "length, sampling parameters)")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput/queue log line")
    g.add_argument("--max-logprobs", type=int, default=20, help="most logprobs/top_logprobs/prompt_logprobs a request "
                   "may ask for (0..20; default 20)")
    g.add_argument("--allowed-origins", type=_json_list, default=None,
                   help="CORS: origins browsers may call from, a JSON list ('[\"*\"]') or one origin; default: no "
                        "CORS headers")
    g.add_argument("--allowed-methods", type=_json_list, default=None, help='CORS methods (default ["*"])')
    g.add_argument("--allowed-headers", type=_json_list, default=None, help='CORS headers (default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--root-path", default=None, help="the path prefix a proxy serves this app under")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key (with --ssl-certfile): serve HTTPS")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate chain")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, help="client certificates: 0 none, 1 optional, 2 required")
    g.add_argument("--response-role", default="assistant", help="the role of chat replies (default assistant)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /openapi.json either (the /docs pages are never served)")
    g.add_argument("--override-generation-config", default=None,
                   help='JSON over the model\'s generation_config.json defaults, e.g. \'{"temperature": 0.5}\'')
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted: no checkpoint code is ever run here (only the built-in architectures load)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors"],
                   help="weights format: safetensors (the only one; auto means it)")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split a thinking model's <think>...</think> reasoning into reasoning_content")
    g.add_argument("--structured-outputs-config", type=_structured_outputs_config, default=None,
                   help='{"backend": "xgrammar"} (or "auto"): the one structured-outputs backend here')


# serve flags whose value is JSON text (a list, an object): a replica gets them back as JSON
JSON_VALUED_FLAGS = frozenset({"allowed_origins", "allowed_methods", "allowed_headers", "structured_outputs_config"})


def _json_list(text: str) -> list[str]:
    """vLLM's list flags take JSON (``'["*"]'``); a plain word is a one-item list."""
    if text.strip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
        return value
    return [text]


def _structured_outputs_config(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict) or value.get("backend", "auto") not in ("auto", "xgrammar") or set(value) - {"backend"}:
        raise argparse.ArgumentTypeError('only {"backend": "auto"} or {"backend": "xgrammar"} (the one backend here)')
    return value


def server_args_from(args: argparse.Namespace, served_names: list[str]):
    """The ServerArgs of the parsed ``serve`` flags (``served_names``: every --served-model-name)."""
    from pagedllm.entrypoints.openai.server_args import ServerArgs

    return ServerArgs(host=args.host, port=args.port, api_key=args.api_key or envs.api_key(),
                      log_level=args.log_level, access_log=args.access_log,
                      shutdown_timeout=args.shutdown_timeout, skip_tokenizer_init=args.skip_tokenizer_init,
                      trust_request_chat_template=args.trust_request_chat_template,
                      chat_template_timeout=args.chat_template_timeout, chat_template=args.chat_template,
                      max_request_body_size=args.max_request_body_size,
                      http_read_timeout=args.http_read_timeout, request_timeout=args.request_timeout,
                      metrics_prefix=args.metrics_prefix, lora_modules=tuple(args.lora_modules or ()),
                      allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                      enable_auto_tool_choice=args.enable_auto_tool_choice,
                      tool_call_parser=args.tool_call_parser,
                      enable_dashboard=args.enable_dashboard,
                      served_model_names=tuple(served_names),
                      uvicorn_log_level=args.uvicorn_log_level, uvicorn_loop=args.uvicorn_loop,
                      uvicorn_http=args.uvicorn_http, enable_log_requests=args.enable_log_requests,
                      disable_log_stats=args.disable_log_stats, max_logprobs=args.max_logprobs,
                      allowed_origins=tuple(args.allowed_origins or ()),
                      allowed_methods=tuple(args.allowed_methods or ("*",)),
                      allowed_headers=tuple(args.allowed_headers or ("*",)),
                      allow_credentials=args.allow_credentials, root_path=args.root_path,
                      ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                      ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                      response_role=args.response_role, disable_fastapi_docs=args.disable_fastapi_docs,
                      override_generation_config=args.override_generation_config,
                      reasoning_parser=args.reasoning_parser)
