"""MultiprocExecutor: tensor parallelism over torch.distributed, one process per rank.

Rank 0 is the driver (this process): the scheduler runs once, here. Each step, the
SchedulerOutput is broadcast (pickled, over gloo) to every rank; all ranks run the forward with
their weight shards and KV heads; rank 0 samples on the gathered logits (and computes any
logprobs) and broadcasts the sampled ids so every rank's request state stays identical.
``execute`` returns rank 0's output; the other ranks' outputs are dropped.

Pipeline parallelism (``pipeline_parallel_size`` P > 1; world = P x TP, stage-major ranks, see
distributed/parallel_state.py): rank 0 runs stage 0 and broadcasts each step as
its SchedulerOutput (the ids sampled by earlier steps in its diffs); each stage receives the previous
stage's hidden states, runs its layers and sends its own on; the last stage's tp rank 0 samples
and sends the ModelRunnerOutput to rank 0. ``submit`` returns once stage 0 has sent its part and
``collect`` waits for the oldest step's output, so the engine keeps up to P steps in flight
(engine/core.py). ``execute`` is one of each.

``MultiprocExecutor`` is an ``executor.base.Executor``; ranks > 0 have no executor, only a
worker. Ranks 1..N-1 are spawned here for a single machine, each engine with a rendezvous
store of its own on a fresh port (rank 0 serves it; a rank that exits before joining, or that
has not joined within the rendezvous timeout, fails the constructor with a RuntimeError naming
it). The workers, the store and the process group go with the engine: on ``shutdown()``, or when
the executor is garbage-collected (``del llm``), or at interpreter exit (weakref.finalize). A
later engine in the same process collects a dropped one first, and refuses to start while an
earlier multi-process engine is still running (one process group per process). Under ``torchrun`` (multi-node) the launcher
starts them instead: they call ``run_worker_rank`` (``pagedllm serve`` does this for RANK > 0).
"""
from __future__ import annotations

import gc
import logging
import os
import weakref
from typing import Optional

import torch

from pagedllm import envs
from pagedllm.config import hf_field
from pagedllm.core.contracts import KVTierSpec, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_SHUTDOWN = "__shutdown__"
_IDLE = "__idle__"  # (_IDLE, seconds): every rank does its idle work, then all agree whether any is left


def stage_partition(config, hf_config) -> list[int]:
    """Decoder layers per pipeline stage (validated against the model): a clear error up front."""
    from pagedllm.distributed.parallel_state import layer_partition

    return layer_partition(hf_config.num_hidden_layers, config.pipeline_parallel_size, config.pp_layer_partition)


def _build_worker(config, hf_config, max_model_len, max_num_batched_tokens, rank, world_size, store=None):
    from pagedllm.distributed.parallel_state import init_distributed
    from pagedllm.worker.worker import Worker, resolve_device

    device = resolve_device(config.device)
    if device.type == "cuda":
        local = envs.local_rank(rank)
        if local >= torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size needs a GPU per rank; only {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local)
    pp = config.pipeline_parallel_size
    group = init_distributed(rank, world_size, device, pp_size=pp,
                             pp_partition=stage_partition(config, hf_config) if pp > 1 else None, store=store)
    worker = Worker(config, hf_config, max_model_len, max_num_batched_tokens)
    return worker, group


def _agree_num_blocks(worker, group) -> int:
    """Every rank sizes its cache once all have loaded their weights (they share a host's memory),
    then all take the smallest block count."""
    import torch.distributed as dist

    dist.barrier(group=group.world_cpu_group)
    n = torch.tensor([worker.determine_num_blocks()], dtype=torch.long)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group.world_cpu_group)  # every stage: one block table
    return int(n.item())


def run_worker_rank(config, hf_config, max_model_len, max_num_batched_tokens, rank, world_size,
                    store=None) -> None:
    """Entry point of a non-driver rank: build the shard, then execute broadcast steps forever."""
    import torch.distributed as dist

    worker, group = _build_worker(config, hf_config, max_model_len, max_num_batched_tokens, rank, world_size, store)
    worker.initialize_cache(_agree_num_blocks(worker, group))
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    dist.gather_object(weight_bytes, None, dst=0, group=group.world_cpu_group)
    from pagedllm.distributed.parallel_state import get_pp_group

    pp = get_pp_group()
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=group.world_cpu_group)
        if msg[0] == _SHUTDOWN:
            break
        if isinstance(msg[0], tuple) and msg[0][0] == _IDLE:
            _idle_work_everywhere(worker, group, msg[0][1])
            continue
        out = worker.execute(msg[0])
        if pp.world_size > 1 and rank == pp.sampler_rank:
            pp.send_object(out, dst=0)
    pp.wait_sends()
    dist.destroy_process_group()


def _idle_work_everywhere(worker, group, seconds: float) -> bool:
    """This rank's idle work (its CPU KV cache's prefault), then whether any rank has some left."""
    import torch.distributed as dist

    left = torch.tensor([int(worker.idle_work(seconds))], dtype=torch.long)
    dist.all_reduce(left, op=dist.ReduceOp.MAX, group=group.world_cpu_group)
    return bool(left.item())


def _spawned_main(rank, world_size, port, args) -> None:
    from pagedllm.distributed.parallel_state import join_store

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        run_worker_rank(*args, rank, world_size, store=join_store(port, world_size, _RENDEZVOUS_TIMEOUT_S))
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    # Leave without the interpreter's teardown: the process group's C++ threads may still be
    # winding down, and destroying them at exit can abort the process (seen with pipeline groups).
    logging.shutdown()
    os._exit(0)


_RENDEZVOUS_TIMEOUT_S = 300.0  # a spawned rank starts an interpreter and imports torch: slow on a busy machine
_LIVE: list = []  # weakref.finalize of every multi-process engine started here and not yet torn down


def _teardown(procs: list) -> None:
    """Kill what is left of one engine's worker processes and drop its process group (the
    store goes with it). Run once: by ``shutdown``, on garbage collection, or at exit."""
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    import torch.distributed as dist

    from pagedllm.distributed.parallel_state import PPGroup, TPGroup, set_pp_group, set_tp_group

    if dist.is_initialized():
        dist.destroy_process_group()
    set_tp_group(TPGroup())
    set_pp_group(PPGroup())


def _release_previous_engines() -> None:
    """Before a new engine's rendezvous: tear down dropped engines (collected now), and refuse
    while one is still in use (this process's one process group is its)."""
    global _LIVE
    _LIVE = [f for f in _LIVE if f.alive]
    if _LIVE:
        gc.collect()
        _LIVE = [f for f in _LIVE if f.alive]
    if _LIVE:
        raise RuntimeError("another multi-process engine (tensor/pipeline parallel) is still running in this "
                           "process: call shutdown() on it (LLM.shutdown(), or llm.engine.shutdown()) or drop every "
                           "reference to it before building a new one")
    import torch.distributed as dist

    if dist.is_initialized():  # left by a group made outside an executor (e.g. a test): not ours to keep
        logger.warning("destroying a torch.distributed process group left in this process before a new engine")
        dist.destroy_process_group()


def _check_layout(config, hf_config) -> None:
    """The heads divide over the tensor ranks, the layers over the stages: clear errors before
    any process starts."""
    tp = config.tensor_parallel_size
    heads = hf_config.num_attention_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide num_attention_heads ({heads})")
    kv_heads = hf_field(hf_config, "num_key_value_heads") or heads
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) and num_key_value_heads ({kv_heads}) must divide one another")
    if config.pipeline_parallel_size > 1:
        stage_partition(config, hf_config)  # a bad pp_layer_partition fails here


def _check_torchrun(torchrun: tuple[int, int], world: int) -> None:
    """Under torchrun: the launcher's world is the engine's, and this is rank 0."""
    if torchrun[1] != world:
        raise ValueError(f"WORLD_SIZE={torchrun[1]} but tensor_parallel_size x "
                         f"pipeline_parallel_size = {world}")
    if torchrun[0] != 0:
        raise RuntimeError("only rank 0 builds the engine; other ranks run run_worker_rank")


def _check_local_resources(config, world: int) -> None:
    """One machine: a GPU per rank, or (CPU) no more tensor ranks than cores."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available()):
        if torch.cuda.device_count() < world:
            raise ValueError(f"{world} ranks (tensor {tp} x pipeline {pp} parallel) need a GPU each, "
                             f"but only {torch.cuda.device_count()} are visible")
    elif tp > (os.cpu_count() or 1):
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {os.cpu_count()} CPU cores available")
    elif world > (os.cpu_count() or 1):
        logger.warning("%d ranks (pipeline %d x tensor %d) share %d CPU cores: the stages will take turns",
                       world, pp, tp, os.cpu_count())


class MultiprocExecutor:
    num_blocks: int
    max_model_len: int
    sliding_window: Optional[int]
    kv_tier_spec: Optional[KVTierSpec]
    weight_bytes_per_rank: list[int]
    max_concurrent_batches: int  # one step per pipeline stage

    def __init__(self, config, hf_config, max_model_len: int, max_num_batched_tokens: int) -> None:
        tp, self.pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        self.max_concurrent_batches = self.pp_size
        world = tp * self.pp_size
        self.world_size = world
        _check_layout(config, hf_config)
        self._in_flight = 0
        self.procs = []
        args = (config, hf_config, max_model_len, max_num_batched_tokens)
        torchrun = envs.torchrun_rank()
        store = None
        self._teardown = weakref.finalize(self, _teardown, self.procs)
        if torchrun is not None:
            _check_torchrun(torchrun, world)
        else:
            _check_local_resources(config, world)
            store = self._spawn_ranks(args)
        try:
            self._start_driver(args, store)
        except BaseException:
            self._teardown()  # no process or process group left behind for a later engine
            raise
        self._dead = False

    def _spawn_ranks(self, args):
        """Ranks 1..world-1 on this machine, each a spawned process joining this engine's own
        rendezvous store (returned)."""
        import torch.multiprocessing as mp

        from pagedllm.distributed.parallel_state import serve_store

        world = self.world_size
        _release_previous_engines()
        store = serve_store(world, _RENDEZVOUS_TIMEOUT_S)
        _LIVE.append(self._teardown)
        ctx = mp.get_context("spawn")
        for r in range(1, world):
            p = ctx.Process(target=_spawned_main, args=(r, world, store.port, args), daemon=True)
            p.start()
            self.procs.append(p)
        return store

    def _start_driver(self, args, store) -> None:
        """Rank 0 (this process): wait for the others, build its worker, agree on the cache with
        them and learn every rank's weight bytes."""
        import torch.distributed as dist

        world = self.world_size
        if store is not None:
            from pagedllm.distributed.parallel_state import wait_for_ranks

            wait_for_ranks(store, self.procs, _RENDEZVOUS_TIMEOUT_S)
        self.worker, self.group = _build_worker(*args, 0, world, store)
        self.num_blocks = _agree_num_blocks(self.worker, self.group)
        self.worker.initialize_cache(self.num_blocks)
        self.max_model_len = self.worker.max_model_len  # every rank fitted the same value
        self.sliding_window = self.worker.kv_sliding_window
        self.kv_tier_spec = self.worker.kv_tier_spec  # every rank sized the same slots
        sizes = [None] * world
        dist.gather_object(sum(p.numel() * p.element_size() for p in self.worker.model.parameters()), sizes,
                           dst=0, group=self.group.world_cpu_group)
        self.weight_bytes_per_rank = sizes

    @property
    def num_forward_tokens(self) -> int:
        return self.worker.runner.num_forward_tokens

    @property
    def is_dead(self) -> bool:
        return self._dead

    @property
    def dead_reason(self) -> Optional[str]:
        return (self._death_note() or "a step failed on the workers") if self._dead else None

    def _check_alive(self) -> None:
        for r, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                self._dead = True
                raise RuntimeError(f"tensor-parallel worker rank {r} died (exit code {p.exitcode})")

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        import torch.distributed as dist

        if self.pp_size > 1:
            self.submit(scheduler_output)
            return self.collect()
        if self._dead:
            raise RuntimeError("a tensor-parallel worker died earlier; the engine cannot continue")
        self._check_alive()
        try:
            dist.broadcast_object_list([scheduler_output.without_grammar()], src=0, group=self.group.cpu_group)
            return self.worker.execute(scheduler_output)  # rank 0 samples: the masks stay here
        except Exception as e:
            self._dead = True
            alive = [p.is_alive() for p in self.procs]
            raise RuntimeError(f"tensor-parallel step failed (workers alive: {alive}): {e}") from e

    # ---- pipeline parallelism: steps in flight ------------------------------------------------
    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step: broadcast it, run stage 0 (its hidden states go to stage 1 without
        waiting). Its output comes from ``collect``, in submission order."""
        import torch.distributed as dist

        if self._dead:
            raise RuntimeError("a pipeline-parallel worker died earlier; the engine cannot continue")
        self._check_alive()
        try:
            dist.broadcast_object_list([scheduler_output], src=0,  # the last stage samples: with the masks
                                       group=self.group.world_cpu_group)
            self.worker.execute(scheduler_output)
        except Exception as e:
            self._dead = True
            raise RuntimeError(f"pipeline-parallel step failed (workers alive: {[p.is_alive() for p in self.procs]}): "
                               f"{e}") from e
        self._in_flight += 1

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's output (from the last stage's sampling rank). A worker
        that dies meanwhile fails this within about a second, never a hang."""
        import threading

        from pagedllm.distributed.parallel_state import get_pp_group

        if self._dead:
            raise RuntimeError("a pipeline-parallel worker died earlier; the engine cannot continue")
        pp = get_pp_group()
        box: list = []

        def receive() -> None:
            try:
                box.append(pp.recv_object(pp.sampler_rank))
            except Exception as e:  # the process group broke (a peer died)
                box.append(e)

        t = threading.Thread(target=receive, name="pagedllm-pp-collect", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.5)
            if t.is_alive():
                try:
                    self._check_alive()
                except RuntimeError:
                    raise RuntimeError(f"pipeline-parallel worker died: {self._death_note()}") from None
        self._in_flight -= 1
        out = box[0]
        if isinstance(out, Exception):
            self._dead = True
            raise RuntimeError(f"pipeline-parallel step failed: {out}") from out
        return out

    def _death_note(self) -> str:
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
        return ", ".join(f"rank {r} died (exit code {c})" for r, c in dead)

    def idle_work(self, seconds: float) -> bool:
        """Every rank's idle work for about ``seconds`` (told as a step is: by a broadcast); whether
        any rank has some left. Nothing while a step is in flight, after a failure, or with a rank
        gone (the next step reports that)."""
        import torch.distributed as dist

        if self._dead or self._in_flight or not all(p.is_alive() for p in self.procs):
            return False
        try:
            dist.broadcast_object_list([(_IDLE, seconds)], src=0, group=self.group.world_cpu_group)
            return _idle_work_everywhere(self.worker, self.group, seconds)
        except Exception as e:
            self._dead = True
            raise RuntimeError(f"idle work on the workers failed (workers alive: {[p.is_alive() for p in self.procs]}): "
                               f"{e}") from e

    def shutdown(self) -> None:
        import torch.distributed as dist

        if not self._dead and dist.is_initialized():
            try:
                self._check_alive()
                while self.pp_size > 1 and self._in_flight:  # steps still in flight: let the stages finish them
                    self.collect()
                dist.broadcast_object_list([_SHUTDOWN], src=0, group=self.group.world_cpu_group)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
        self._teardown()


def launched_as_worker_rank() -> bool:
    """True in a torchrun-launched process whose rank is not 0 (it serves no API, only steps)."""
    torchrun = envs.torchrun_rank()
    return torchrun is not None and torchrun[0] != 0


def serve_as_worker_rank(config) -> None:
    """Multi-node entry for ranks > 0: same config as rank 0, then execute its broadcast steps.

        torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HOST --master-port 29500 \\
            -m pagedllm.entrypoints.cli serve MODEL --tensor-parallel-size 2
    """
    from pagedllm.config import resolve_max_model_len, resolve_max_num_batched_tokens
    from pagedllm.models.config_json import load_hf_config

    hf_config = load_hf_config(config.model)
    max_model_len = resolve_max_model_len(hf_config, config.max_model_len)
    rank, world = envs.torchrun_rank()
    run_worker_rank(config, hf_config, max_model_len, resolve_max_num_batched_tokens(config, max_model_len),
                    rank, world)
