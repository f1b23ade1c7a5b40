"""MultiprocExecutor: tensor parallelism over torch.distributed, one process per rank.

Rank 0 is the driver (this process): the scheduler runs once, here. Each step, the
SchedulerOutput is broadcast (pickled, over gloo) to every rank; all ranks run the forward with
their weight shards and KV heads; rank 0 samples on the gathered logits (and computes any
logprobs) and broadcasts the sampled ids so every rank's request state stays identical.
``execute`` returns rank 0's output; the other ranks' outputs are dropped.

``MultiprocExecutor`` is an ``executor.base.Executor``; ranks > 0 have no executor, only a
worker. Ranks 1..N-1 are spawned here for a single machine. Under ``torchrun`` (multi-node) the launcher
starts them instead: they call ``run_worker_rank`` (``pagedllm serve`` does this for RANK > 0).
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Optional

import torch

from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_SHUTDOWN = "__shutdown__"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_worker(config, hf_config, max_model_len, max_num_batched_tokens, rank, world_size):
    from pagedllm.distributed.parallel_state import init_distributed
    from pagedllm.worker.worker import Worker, resolve_device

    device = resolve_device(config.device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size needs a GPU per rank; only {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local)
    group = init_distributed(rank, world_size, device)
    worker = Worker(config, hf_config, max_model_len, max_num_batched_tokens)
    return worker, group


def _agree_num_blocks(worker, group) -> int:
    """Every rank sizes its cache once all have loaded their weights (they share a host's memory),
    then all take the smallest block count."""
    import torch.distributed as dist

    dist.barrier(group=group.cpu_group)
    n = torch.tensor([worker.determine_num_blocks()], dtype=torch.long)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(n.item())


def run_worker_rank(config, hf_config, max_model_len, max_num_batched_tokens, rank, world_size) -> None:
    """Entry point of a non-driver rank: build the shard, then execute broadcast steps forever."""
    import torch.distributed as dist

    worker, group = _build_worker(config, hf_config, max_model_len, max_num_batched_tokens, rank, world_size)
    worker.initialize_cache(_agree_num_blocks(worker, group))
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    dist.gather_object(weight_bytes, None, dst=0, group=group.cpu_group)
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=group.cpu_group)
        if msg[0] == _SHUTDOWN:
            break
        worker.execute(msg[0])
    dist.destroy_process_group()


def _spawned_main(rank, world_size, port, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        run_worker_rank(*args, rank, world_size)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)


class MultiprocExecutor:
    num_blocks: int
    max_model_len: int
    sliding_window: Optional[int]
    weight_bytes_per_rank: list[int]

    def __init__(self, config, hf_config, max_model_len: int, max_num_batched_tokens: int) -> None:
        import torch.multiprocessing as mp

        world = config.tensor_parallel_size
        self.world_size = world
        heads = hf_config.num_attention_heads
        if heads % world:
            raise ValueError(f"tensor_parallel_size ({world}) must divide num_attention_heads ({heads})")
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if kv_heads % world and world % kv_heads:
            raise ValueError(f"tensor_parallel_size ({world}) and num_key_value_heads ({kv_heads}) must divide one another")
        self.procs = []
        args = (config, hf_config, max_model_len, max_num_batched_tokens)
        launched_by_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        saved_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
        if launched_by_torchrun:
            if int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but tensor_parallel_size={world}")
            if int(os.environ["RANK"]) != 0:
                raise RuntimeError("only rank 0 builds the engine; other ranks run run_worker_rank")
        else:
            if config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available()):
                if torch.cuda.device_count() < world:
                    raise ValueError(f"tensor_parallel_size={world} but only {torch.cuda.device_count()} GPUs are visible")
            elif world > (os.cpu_count() or 1):
                raise ValueError(f"tensor_parallel_size={world} exceeds the {os.cpu_count()} CPU cores available")
            port = _free_port()
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE=str(world))
            ctx = mp.get_context("spawn")
            for r in range(1, world):
                p = ctx.Process(target=_spawned_main, args=(r, world, port, args), daemon=True)
                p.start()
                self.procs.append(p)
        try:
            self.worker, self.group = _build_worker(*args, 0, world)
            self.num_blocks = _agree_num_blocks(self.worker, self.group)
            self.worker.initialize_cache(self.num_blocks)
            self.max_model_len = self.worker.max_model_len  # every rank fitted the same value
            self.sliding_window = self.worker.kv_sliding_window
            import torch.distributed as dist

            sizes = [None] * world
            dist.gather_object(sum(p.numel() * p.element_size() for p in self.worker.model.parameters()), sizes,
                               dst=0, group=self.group.cpu_group)
            self.weight_bytes_per_rank = sizes
        except Exception:
            self._kill()
            raise
        finally:
            if not launched_by_torchrun:  # leave no rendezvous variables behind for a later engine
                for k, v in saved_env.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        self._dead = False

    @property
    def num_forward_tokens(self) -> int:
        return self.worker.runner.num_forward_tokens

    @property
    def is_dead(self) -> bool:
        return self._dead

    def _check_alive(self) -> None:
        for r, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                self._dead = True
                raise RuntimeError(f"tensor-parallel worker rank {r} died (exit code {p.exitcode})")

    def execute(self, scheduler_output: SchedulerOutput, grammar=None) -> ModelRunnerOutput:
        import torch.distributed as dist

        if self._dead:
            raise RuntimeError("a tensor-parallel worker died earlier; the engine cannot continue")
        self._check_alive()
        try:
            dist.broadcast_object_list([scheduler_output], src=0, group=self.group.cpu_group)
            return self.worker.execute(scheduler_output, grammar)  # rank 0 samples: the masks stay here
        except Exception as e:
            self._dead = True
            alive = [p.is_alive() for p in self.procs]
            raise RuntimeError(f"tensor-parallel step failed (workers alive: {alive}): {e}") from e

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if not self._dead and dist.is_initialized():
            try:
                self._check_alive()
                dist.broadcast_object_list([_SHUTDOWN], src=0, group=self.group.cpu_group)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
        self._kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        from pagedllm.distributed.parallel_state import TPGroup, set_tp_group

        set_tp_group(TPGroup())


def launched_as_worker_rank() -> bool:
    """True in a torchrun-launched process whose rank is not 0 (it serves no API, only steps)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("RANK", "0")) != 0


def serve_as_worker_rank(config) -> None:
    """Multi-node entry for ranks > 0: same config as rank 0, then execute its broadcast steps.

        torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HOST --master-port 29500 \\
            -m pagedllm.entrypoints.cli serve MODEL --tensor-parallel-size 2
    """
    from pagedllm.config import resolve_max_model_len, resolve_max_num_batched_tokens
    from pagedllm.models.config_json import load_hf_config

    hf_config = load_hf_config(config.model)
    max_model_len = resolve_max_model_len(hf_config, config.max_model_len)
    run_worker_rank(config, hf_config, max_model_len, resolve_max_num_batched_tokens(config, max_model_len),
                    int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
