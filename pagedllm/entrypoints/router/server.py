"""Running the router: ``pagedllm router --backends URL...`` (its flags and the uvicorn server)."""
from __future__ import annotations

import argparse
from typing import Optional

from pagedllm.entrypoints.router.replicas import POLICIES


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Routing flags shared by ``pagedllm router`` and ``pagedllm serve --data-parallel-size``."""
    g = parser.add_argument_group("router")
    g.add_argument("--routing", default="prefix", choices=POLICIES,
                   help="prefix: the replica holding the longest cached prefix of the prompt, else the least "
                        "loaded; least_loaded; round_robin (default prefix)")
    g.add_argument("--router-index-blocks", type=int, default=1 << 16,
                   help="block hashes remembered per replica (LRU); about the replicas' KV cache block count")
    g.add_argument("--router-max-load-imbalance", type=int, default=8,
                   help="a prefix owner with this many more requests in flight than the least loaded replica "
                        "is passed over (default 8)")
    g.add_argument("--router-min-prefix-ratio", type=float, default=0.5,
                   help="route by cached prefix only when it covers at least this fraction of the prompt's "
                        "blocks (a chat template's shared first block should not decide); default 0.5")
    g.add_argument("--router-health-interval", type=float, default=2.0,
                   help="seconds between /health polls of each replica (default 2)")
    g.add_argument("--router-retry-max", type=float, default=30.0,
                   help="longest wait before a replica taken out is checked again (backoff doubles from 1 s)")


def add_router_parser(sub) -> None:
    p = sub.add_parser("router", help="route OpenAI requests across pagedllm servers by cached prefix")
    p.add_argument("--backends", nargs="+", required=True, metavar="URL",
                   help="the replicas' base URLs (http://host:port)")
    p.add_argument("--model", default=None,
                   help="the served model's directory, for its tokenizer and chat template (without it: "
                        "routing by load only)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--served-model-name", nargs="*", default=None, help="the replicas' served model name(s)")
    p.add_argument("--block-size", type=int, default=16, help="the replicas' --block-size (default 16)")
    p.add_argument("--chat-template", default=None, help="the replicas' --chat-template, if they use one")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' here, before a body is read (env PAGEDLLM_API_KEY)")
    p.add_argument("--max-request-body-size", type=int, default=64 << 20,
                   help="largest request body in bytes (413 above it; default 64 MiB)")
    p.add_argument("--http-read-timeout", type=float, default=30.0,
                   help="seconds to receive a request's headers, and between its body's chunks (408; default 30)")
    add_router_args(p)


def router_args_from(args: argparse.Namespace, backends, model: Optional[str], tokenizer: Optional[str],
                     served_model_names, block_size: int, chat_template: Optional[str]):
    from pagedllm import envs
    from pagedllm.entrypoints.router.args import RouterArgs

    # ``args``: the router's or serve's flags (both have these); serve's body size may be unset
    bounds = {"max_request_body_size": args.max_request_body_size, "http_read_timeout": args.http_read_timeout}
    return RouterArgs(
        api_key=args.api_key or envs.api_key(), **{k: v for k, v in bounds.items() if v is not None},
        backends=tuple(backends), model=model, tokenizer=tokenizer, served_model_names=tuple(served_model_names or ()),
        block_size=block_size, policy=args.routing, index_capacity_blocks=args.router_index_blocks,
        max_load_imbalance=args.router_max_load_imbalance, min_prefix_ratio=args.router_min_prefix_ratio, health_interval_s=args.router_health_interval,
        retry_max_s=args.router_retry_max, chat_template=chat_template, host=args.host, port=args.port,
        log_level=args.log_level,
    )


def serve_router(rargs, stop_requested=lambda: False) -> int:
    """Serve until SIGTERM/SIGINT (graceful: in-flight requests get 30 s); exit code 0."""
    import uvicorn

    from pagedllm.entrypoints.router.app import build_router_app

    from pagedllm.entrypoints.http_guard import event_loop, http_protocol, listen_socket

    sock = listen_socket(rargs.host, rargs.port)
    app = build_router_app(rargs)
    server = uvicorn.Server(uvicorn.Config(app, host=rargs.host, port=rargs.port, log_level=rargs.log_level,
                                           timeout_keep_alive=5, timeout_graceful_shutdown=30,
                                           loop=event_loop("auto"), http=http_protocol("auto", rargs.http_read_timeout)))
    if not stop_requested():
        server.run(sockets=[sock])
    return 0


def run_router_command(args: argparse.Namespace, stop_requested=lambda: False) -> int:
    rargs = router_args_from(args, args.backends, args.model, args.tokenizer, args.served_model_name,
                             args.block_size, args.chat_template)
    return serve_router(rargs, stop_requested)
