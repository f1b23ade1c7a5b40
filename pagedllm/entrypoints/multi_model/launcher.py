"""``pagedllm serve --model A --model B`` (or ``--models-dir``, ``--models-config``): one server,
several models, each loaded on its first request into a ``pagedllm serve`` child of its own on an
internal port (127.0.0.1), unloaded under ``--models-memory`` or after ``--model-idle-timeout``.

Why a child server per model: unloading one is ending a process, so its memory (weights, KV
cache, the allocator's arenas, torch's threads) is back with the OS at once; a model that fails
or crashes takes no other model down; every single-server feature (pooling, LoRA, structured
outputs, the Responses API, GGUF files) works per model unchanged. A child runs its engine in
its own process (no separate engine-core process unless asked: the front here already keeps HTTP
off the engine's thread). The children die with this process (``Replicas``' parent pipe).

Each child gets the command line's serve flags, then its own options from --models-config; its
KV cache is ``--kv-cache-memory`` (per model, or for all), by default an eighth of the budget,
and is not prefaulted while idle (its pages are taken as requests use them; the budget counts it
whole from the start).
"""
from __future__ import annotations

import argparse
import logging
import sys
import threading

from pagedllm import envs
from pagedllm.entrypoints.multi_model.catalog import build_catalog
from pagedllm.entrypoints.multi_model.manager import ManagerSettings, ModelManager
from pagedllm.entrypoints.multi_model.process import ModelProcess

logger = logging.getLogger("pagedllm.entrypoints.multi_model")

MULTI_MODEL_FLAGS = frozenset({"models_dir", "models_config", "models_memory", "model_idle_timeout", "pin_model",
                               "model_load_timeout"})
# the front serves these itself: the children speak plain HTTP to it on 127.0.0.1
_FRONT_ONLY = frozenset({"ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "root_path",
                         "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials",
                         "served_model_name", "kv_cache_memory"})


def model_paths(args: argparse.Namespace) -> list[str]:
    return list(dict.fromkeys(([args.model_pos] if args.model_pos else []) + list(args.model or [])))


def is_multi_model(args: argparse.Namespace) -> bool:
    return len(model_paths(args)) > 1 or bool(args.models_dir or args.models_config)


def default_memory_budget() -> int:
    """80% of what this machine (or its cgroup) has available now."""
    from pagedllm.worker.memory_plan import read_host_memory

    return int(read_host_memory().available * 0.8)


def settings_from(args: argparse.Namespace) -> ManagerSettings:
    budget = args.models_memory or default_memory_budget()
    if budget <= 0:
        raise ValueError(f"--models-memory must be > 0 bytes, got {budget}")
    for flag, value in (("--model-idle-timeout", args.model_idle_timeout), ("--model-load-timeout",
                                                                             args.model_load_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {value}")
    kv = args.kv_cache_memory or max(64 << 20, budget // 8)
    return ManagerSettings(memory_budget=budget, kv_cache_bytes=kv, idle_timeout_s=args.model_idle_timeout,
                           load_timeout_s=args.model_load_timeout, stop_timeout_s=args.shutdown_timeout)


def child_command(entry, port: int, common: list[str], settings: ManagerSettings) -> list[str]:
    own = set(entry.flags)
    kv = [] if {"--kv-cache-memory"} & own else ["--kv-cache-memory", str(settings.kv_cache_bytes)]
    core = [] if own & {"--engine-core-process", "--no-engine-core-process"} or "--engine-core-process" in common \
        else ["--no-engine-core-process"]
    # no idle prefault: a model's KV cache then holds memory only as it is used (and the budget counts it whole)
    given = own | set(common)
    prefault = [] if {"--cpu-kv-cache-idle-prefault", "--cpu-kv-cache-prefault"} & given \
        else ["--cpu-kv-cache-idle-prefault", "0"]
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", entry.path, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", *entry.names, *common, *kv, *core, *prefault, *entry.flags]


def run_multi_model(args: argparse.Namespace, serve_parser: argparse.ArgumentParser) -> int:
    """Serve every model of the catalog until SIGTERM/SIGINT; exit code 0 after a graceful stop."""
    import uvicorn

    from pagedllm.entrypoints.http_guard import event_loop, http_protocol, listen_socket
    from pagedllm.entrypoints.multi_model.app import FrontState, build_front_app
    from pagedllm.entrypoints.router.data_parallel import _free_port, child_flags

    if args.data_parallel_size != 1:
        raise ValueError("--data-parallel-size is for one model: a server of several models runs each model "
                         "once (run a data-parallel server per model instead)")
    entries = build_catalog(args, vars(serve_parser.parse_args([])))
    settings = settings_from(args)
    common = child_flags(serve_parser, args, exclude=MULTI_MODEL_FLAGS | _FRONT_ONLY)
    api_key = args.api_key or envs.api_key()

    def launch(entry, model):
        port = _free_port()
        env = {"PAGEDLLM_API_KEY": api_key} if api_key else {}  # not on the command line
        return ModelProcess(entry.name, child_command(entry, port, common, settings), env), f"http://127.0.0.1:{port}"

    sock = listen_socket(args.host, args.port)  # a bad host or a busy port: before any model starts
    manager = ModelManager(entries, settings, launch, client=None)
    state = FrontState(entries=entries, manager=manager, api_key=api_key,
                       max_body_size=args.max_request_body_size or 64 << 20, http_read_timeout=args.http_read_timeout,
                       request_timeout=args.request_timeout, wait_timeout=args.model_load_timeout,
                       enable_dashboard=args.enable_dashboard)
    app = build_front_app(state)
    if args.allowed_origins:  # outermost: a browser's preflight needs no API key
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(args.allowed_origins),
                           allow_methods=list(args.allowed_methods or ("*",)),
                           allow_headers=list(args.allowed_headers or ("*",)), allow_credentials=args.allow_credentials)
    logger.info("serving %d models (%s) under a %d MiB budget", len(entries), ", ".join(e.name for e in entries),
                settings.memory_budget >> 20)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # stop accepting; every model server drains now
            super().handle_exit(sig, frame)
            manager.closing = True
            threading.Thread(target=lambda: [m.process.terminate() for m in list(manager.models.values())
                                             if m.process is not None], daemon=True).start()

    ssl = {k: getattr(args, k) for k in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs")
           if getattr(args, k, None) is not None}
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=5,
                                    timeout_graceful_shutdown=args.shutdown_timeout + 10, loop=event_loop("auto"),
                                    http=http_protocol("auto", args.http_read_timeout), root_path=args.root_path or "",
                                    **ssl))
    if not args.stop_requested():
        server.run(sockets=[sock])
    return 0
