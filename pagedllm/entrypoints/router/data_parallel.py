"""``pagedllm serve --data-parallel-size N``: N engine replicas behind one API server.

Shape chosen: N child ``pagedllm serve`` processes on internal ports (127.0.0.1), each a whole
server with its own engine (and its own TP ranks), and this process running the router in front
of them on the public port. Why this shape: a replica is then exactly what ``pagedllm router``
fronts when servers are started by hand or by Kubernetes (one code path, one set of tests); a
replica that crashes takes nothing else down (the router takes it out and keeps answering);
and each engine keeps its own process, GIL and detokenizer, which on CPU is where the front-end
time goes. The cost is one extra local HTTP hop per request (~0.2 ms; streamed chunks are relayed
as they come).

Resources: on CPU the allowed cores are split evenly, replica i pinned to its share through the
existing ``cpu_threads_bind`` (its TP ranks split that share again); ``nobind`` leaves the OS to
schedule but still sets each replica's thread count to its share. On GPU, replica i sees its own
``tensor_parallel_size`` devices through CUDA_VISIBLE_DEVICES.

Lifecycle: the replicas die with this process, however it ends (SIGKILL included): each watches
a pipe whose write end only this process holds (EOF: the parent is gone) and, on Linux, also has
PR_SET_PDEATHSIG; either way it gets SIGTERM and stops as a server does. SIGTERM here stops the
router from accepting and at once passes SIGTERM on to the replicas, which drain as a plain
server does (``--shutdown-timeout``, then an error event and ``[DONE]`` for each open stream);
the router relays that to the end before it exits.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from pagedllm import envs
from pagedllm.entrypoints.cli_serve_flags import JSON_VALUED_FLAGS
from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

_NOT_FORWARDED = {"data_parallel_size", "host", "port", "model_pos", "model", "api_key", "cpu_threads_bind", "cpu_threads", "routing",
                  "router_index_blocks", "router_max_load_imbalance", "router_min_prefix_ratio", "router_health_interval", "router_retry_max",
                  "help", "version"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def replica_cpu_flags(config: EngineConfig, dp: int, allowed: Optional[list[int]] = None) -> list[list[str]]:
    """Per replica, the --cpu-threads-bind / --cpu-threads flags that give it its share of cores."""
    bind, tp = config.cpu_threads_bind, config.tensor_parallel_size * config.pipeline_parallel_size  # ranks per replica
    if bind not in (None, "auto", "nobind"):
        raise ValueError("with --data-parallel-size, --cpu-threads-bind takes auto or nobind (each replica gets an "
                         f"even share of the allowed CPUs), got {bind!r}")
    if allowed is None:
        try:
            allowed = sorted(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            allowed = list(range(os.cpu_count() or 1))
    share = len(allowed) // dp
    if share < tp:
        raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp} needs {dp * tp} CPU cores; "
                         f"{len(allowed)} are allowed")
    flags = []
    for i in range(dp):
        mine = allowed[i * share:(i + 1) * share]
        threads = config.cpu_threads or share // tp
        if bind == "nobind":
            flags.append(["--cpu-threads-bind", "nobind", "--cpu-threads", str(threads)])
            continue
        per_rank = share // tp
        lists = [_cpu_list(mine[r * per_rank:(r + 1) * per_rank]) for r in range(tp)]
        flags.append(["--cpu-threads-bind", "|".join(lists)] +
                     (["--cpu-threads", str(config.cpu_threads)] if config.cpu_threads else []))
    return flags


def replica_gpu_env(config: EngineConfig, dp: int) -> list[dict[str, str]]:
    """Per replica, the CUDA_VISIBLE_DEVICES that gives it its own tensor_parallel_size GPUs."""
    if not config.device.startswith("cuda"):
        return [{} for _ in range(dp)]
    tp = config.tensor_parallel_size * config.pipeline_parallel_size  # ranks (one GPU each) per replica
    visible = envs.cuda_visible_devices()
    if visible is None:
        import torch

        visible = [str(i) for i in range(torch.cuda.device_count())]
    if len(visible) < dp * tp:
        raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp} needs {dp * tp} GPUs; "
                         f"{len(visible)} are visible")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(visible[i * tp:(i + 1) * tp])} for i in range(dp)]


def child_flags(serve_parser: argparse.ArgumentParser, args: argparse.Namespace,
                exclude: frozenset[str] = frozenset()) -> list[str]:
    """The ``pagedllm serve`` flags the user gave, rebuilt from the parsed namespace (so every
    spelling of them works), minus the ones the launcher sets per replica. A flag given is a
    value other than its default (the serve parser's own namespace of defaults: argparse lists
    its flags only in private attributes); each serve flag is spelled after its dest, and a
    boolean is a switch (--x, or --no-x for a BooleanOptionalAction turned off)."""
    out: list[str] = []
    for dest, default in vars(serve_parser.parse_args([])).items():
        if dest in _NOT_FORWARDED or dest in exclude:
            continue
        value = getattr(args, dest)
        if value is None or value == default:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif dest in JSON_VALUED_FLAGS:  # given as JSON text: passed on as JSON text
            out += [flag, json.dumps(value)]
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def watch_parent() -> None:
    """In a replica (``PAGEDLLM_PARENT_PIPE_FD`` set): SIGTERM to this process when the launcher
    dies -- its pipe reaches EOF (any OS), or PR_SET_PDEATHSIG fires (Linux)."""
    import signal

    fd = envs.take_parent_pipe_fd()
    if fd is None:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux
        pass

    def wait_for_eof() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        logger.warning("the data-parallel launcher is gone: stopping this replica")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait_for_eof, name="pagedllm-parent-watch", daemon=True).start()


class Replicas:
    """The child servers: started together, stopped together (SIGTERM, then kill); each dies with
    this process (``watch_parent``: a pipe per replica whose write end stays here)."""

    def __init__(self, commands: list[list[str]], envs_: list[dict[str, str]], stderr=None) -> None:
        self.procs: list[subprocess.Popen] = []
        self._pipes: list[int] = []  # write ends, never written: closed when this process ends
        for cmd, extra in zip(commands, envs_):
            read_end, write_end = os.pipe()
            try:
                self.procs.append(subprocess.Popen(cmd, env={**os.environ, **extra, envs.PARENT_PIPE_FD: str(read_end)},
                                                   pass_fds=(read_end,), stderr=stderr))
            finally:
                os.close(read_end)
            os.set_inheritable(write_end, False)
            self._pipes.append(write_end)

    def all_exited(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def terminate(self) -> None:
        """SIGTERM to every replica still running: each begins its drain."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()

    def stop(self, timeout: float) -> None:
        self.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for fd in self._pipes:
            os.close(fd)
        self._pipes = []


def run_data_parallel(config: EngineConfig, args: argparse.Namespace, serve_parser: argparse.ArgumentParser) -> int:
    """Start the replicas, serve the router until SIGTERM/SIGINT, stop the replicas; the exit code
    is 1 when every replica exited on its own (e.g. a start-up error), else 0."""
    import uvicorn

    from pagedllm.entrypoints.http_guard import event_loop, http_protocol, listen_socket
    from pagedllm.entrypoints.router.app import build_router_app
    from pagedllm.entrypoints.router.server import router_args_from

    dp = args.data_parallel_size
    sock = listen_socket(args.host, args.port)  # a bad host or a busy port: before any replica starts
    cpu_flags = replica_cpu_flags(config, dp) if not config.device.startswith("cuda") else [[] for _ in range(dp)]
    gpu_env = replica_gpu_env(config, dp)
    ports = [_free_port() for _ in range(dp)]
    base = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", config.model,
            *child_flags(serve_parser, args)]
    commands = [base + ["--host", "127.0.0.1", "--port", str(p), *cpu_flags[i]] for i, p in enumerate(ports)]
    given = args.served_model_name  # serve's --served-model-name: a list, or None
    names = list(given) if isinstance(given, list) else [config.served_model_name] if config.served_model_name else []
    rargs = router_args_from(args, [f"http://127.0.0.1:{p}" for p in ports], config.model, config.tokenizer, names,
                             config.block_size, args.chat_template)
    if not config.enable_prefix_caching and rargs.policy == "prefix":  # no cache to route to
        rargs = dataclasses.replace(rargs, policy="least_loaded")
    app = build_router_app(rargs)  # loads the tokenizer: an error here starts no replica
    logger.info("data parallel: %d replicas on ports %s, routing %s", dp, ports, rargs.policy)
    api_key = args.api_key or envs.api_key()  # to the children by environment, not in their command lines
    replicas = Replicas(commands, [{**e, **({"PAGEDLLM_API_KEY": api_key} if api_key else {})} for e in gpu_env])
    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # stop accepting; the replicas drain their streams now
            super().handle_exit(sig, frame)
            replicas.terminate()

    # the replicas end what is still open after shutdown_timeout; their last events need a moment more
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                    timeout_keep_alive=5, timeout_graceful_shutdown=args.shutdown_timeout + 10,
                                    loop=event_loop("auto"), http=http_protocol("auto", rargs.http_read_timeout)))
    failed = threading.Event()

    def watch() -> None:
        while not server.should_exit:
            if replicas.all_exited():
                logger.error("every data-parallel replica exited; stopping")
                failed.set()
                server.should_exit = True
                return
            time.sleep(0.5)

    threading.Thread(target=watch, name="pagedllm-dp-watch", daemon=True).start()
    try:
        if not args.stop_requested():
            server.run(sockets=[sock])
    finally:
        server.should_exit = True
        replicas.stop(args.shutdown_timeout + 10)
    return 1 if failed.is_set() else 0
