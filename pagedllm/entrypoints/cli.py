"""The ``pagedllm`` command: ``pagedllm generate`` (offline) and ``pagedllm serve`` (OpenAI server).

Engine flags are derived from EngineConfig's fields. Imports stay lazy: parsing flags loads
neither torch nor transformers, so ``pagedllm serve`` answers HTTP quickly.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional, Sequence

from pagedllm.config import (default_model_path, runs_on_cpu, serve_default_max_num_seqs,
                             serve_default_max_num_seqs_per_request)
from pagedllm.entrypoints.cli_engine_flags import ENGINE_FLAG_HELP, add_engine_args, engine_config_from_args, parse_size
from pagedllm.entrypoints.cli_serve_flags import add_serve_parser, server_args_from

__all__ = ["ENGINE_FLAG_HELP", "add_engine_args", "engine_config_from_args", "main", "parse_size", "sub_parser"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="Paged-KV-cache LLM inference and serving.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    parser.subcommands = sub.choices  # name -> that subcommand's parser (sub_parser)
    _add_generate_parser(sub)
    add_serve_parser(sub)
    from pagedllm.entrypoints.router.server import add_router_parser

    add_router_parser(sub)
    from pagedllm.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args)
    return parser


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text offline and print it")
    gen.add_argument("prompt", nargs="*", help="prompts (default: read one prompt per line from stdin)")
    gen.add_argument("--model", default=None, help="model directory (default: the embedded tiny-shakespeare)")
    unset = " (default: the model's generation_config.json, else %s)"
    gen.add_argument("--max-tokens", type=int, default=None, help="tokens to generate" + unset % 64)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy" + unset % 1.0)
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling" + unset % 1.0)
    gen.add_argument("--top-k", type=int, default=None, help="top-k sampling, 0 = off" + unset % 0)
    gen.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    add_engine_args(gen, exclude=("seed",))


def sub_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand (``serve``) of the ``pagedllm`` parser."""
    return parser.subcommands[name]


def _generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompt)
    if not prompts:
        if sys.stdin.isatty():
            print("pagedllm generate: give prompts as arguments or on stdin", file=sys.stderr)
            return 2
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "max_tokens": args.max_tokens}
    params = SamplingParams(**{"max_tokens": 64, **llm.engine.default_sampling_params,
                               **{k: v for k, v in given.items() if v is not None},
                               "n": args.n, "seed": args.sampling_seed})
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if len(prompts) > 1 or args.n > 1:
            print(f"=== prompt {i}: {prompt!r}")
        for o in out.outputs:
            if args.n > 1:
                print(f"--- completion {o.index} ({o.finish_reason})")
            print(prompt + o.text if not args.chat else o.text)
    return 0


def _bench_llm(args: argparse.Namespace):
    """The offline engine of ``pagedllm bench throughput|latency``: the engine flags, --seed."""
    from pagedllm.entrypoints.llm import LLM

    config = dataclasses.replace(engine_config_from_args(args), seed=args.seed)
    return LLM(**dataclasses.asdict(config))


def _catch_stop_signals():
    """Until the server installs its handlers, remember SIGTERM/SIGINT instead of dying, so a
    stop during start-up is still a graceful one (exit 0). Returns "was one received?"."""
    import signal

    got: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: got.append(s))
    return lambda: bool(got)


def _warm_engine_imports() -> None:
    """Start importing torch and the model code on a side thread while the web stack loads."""
    import threading

    def work() -> None:
        try:
            import pagedllm.worker.worker  # noqa: F401  (torch, models, attention)
        except Exception:  # the engine loader will report it
            pass

    threading.Thread(target=work, name="pagedllm-warm-imports", daemon=True).start()


def _configure_logging(args: argparse.Namespace) -> None:
    import logging

    level = getattr(args, "log_level", "warning").upper()
    if args.command == "serve":  # every line names the HTTP request it belongs to ("-": none)
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
        from pagedllm.entrypoints.request_id import RequestIdFilter

        for handler in logging.getLogger().handlers:
            handler.addFilter(RequestIdFilter())
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _bench(args: argparse.Namespace, argv: Optional[Sequence[str]], parser: argparse.ArgumentParser) -> int:
    from pagedllm.bench.cli import run_bench

    return run_bench(args, argv, _bench_llm, sub_parser(parser, "bench"))


def _router(args: argparse.Namespace, argv: Optional[Sequence[str]], parser: argparse.ArgumentParser) -> int:
    from pagedllm.entrypoints.router.server import run_router_command

    # a stop before uvicorn takes over, and the one it re-raises after its graceful stop: exit 0
    return run_router_command(args, _catch_stop_signals())


def _serve_defaults(args: argparse.Namespace) -> list[str]:
    """The model and the defaults ``serve`` derives from the other flags; returns every
    --served-model-name (all routable)."""
    from pagedllm.entrypoints.multi_model.launcher import model_paths

    args.model = (model_paths(args) or [None])[0]
    served_names = list(args.served_model_name or ())  # --served-model-name a b: all routable
    if not args.model and not args.served_model_name:  # the embedded default model
        args.served_model_name = os.path.basename(default_model_path())
    if args.max_num_seqs is None:  # on CPU a smaller running batch (config.CPU_SERVE_MAX_NUM_SEQS)
        args.max_num_seqs = serve_default_max_num_seqs(args.device)
    if args.max_num_seqs_per_request is None:  # a server's clients share the batch (offline: all slots)
        args.max_num_seqs_per_request = serve_default_max_num_seqs_per_request(args.max_num_seqs)
    return served_names


def _serve(args: argparse.Namespace, argv: Optional[Sequence[str]], parser: argparse.ArgumentParser) -> int:
    args.stop_requested = _catch_stop_signals()
    from pagedllm.entrypoints.router.data_parallel import watch_parent

    watch_parent()  # a data-parallel replica or a multi-model server's model: SIGTERM when its launcher dies
    from pagedllm.entrypoints.multi_model.launcher import is_multi_model, run_multi_model

    if is_multi_model(args):
        return run_multi_model(args, sub_parser(parser, "serve"))
    served_names = _serve_defaults(args)
    config = engine_config_from_args(args)
    if args.data_parallel_size != 1:
        if args.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
        from pagedllm.entrypoints.router.data_parallel import run_data_parallel

        return run_data_parallel(config, args, sub_parser(parser, "serve"))
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        from pagedllm.executor.multiproc import launched_as_worker_rank, serve_as_worker_rank

        if launched_as_worker_rank():  # torchrun rank > 0: no HTTP, just the model shard's steps
            serve_as_worker_rank(config)
            return 0
    from pagedllm.entrypoints.openai.api_server import run_server

    server_args = server_args_from(args, served_names)
    from pagedllm.entrypoints.http_guard import listen_socket

    sock = listen_socket(server_args.host, server_args.port)  # a bad host or a busy port: one line
    # only now (no error exit can race it): a process leaving while this thread is inside
    # torch's C++ start-up aborts ("terminate called without an active exception", 134)
    _warm_engine_imports()
    return run_server(config, server_args, args.stop_requested, sock=sock)


_COMMANDS = {"generate": lambda args, argv, parser: _generate(args), "bench": _bench, "router": _router,
             "serve": _serve}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from pagedllm.version import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    _configure_logging(args)
    try:
        if args.command in ("generate", "serve") and runs_on_cpu(args.device):
            from pagedllm.worker.cpu_threads import apply_omp_environment

            apply_omp_environment()  # before torch loads: libgomp reads it once (ranks and replicas inherit it)
        return _COMMANDS[args.command](args, argv, parser)
    except ValueError as e:  # bad configuration: one clear line, no traceback
        print(f"pagedllm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
