"""RayExecutor: the tensor-parallel ranks as Ray actors, across the nodes of a Ray cluster.

``distributed_executor_backend="ray"``. The engine process joins the Ray cluster (``ray.init()``:
the cluster ``ray start --head`` / ``ray start --address=HEAD:6379`` made, found through
RAY_ADDRESS or the local session; a fresh local one if there is none), reserves one bundle per
rank in a placement group (``{"CPU": c}`` or ``{"CPU": c, "GPU": 1}``; PACK: as few nodes as
fit), and starts one actor per rank in its bundle. Every rank, rank 0 included, is an actor: the
engine process holds no weights and may run on a node without accelerators.

Rendezvous: rank 0's actor reports its node's IP address (as Ray sees it) and a free port there;
every actor sets MASTER_ADDR/MASTER_PORT to them and joins torch.distributed (gloo on CPU, NCCL
plus a gloo control group on GPU) exactly as the mp ranks do, so the model code is unchanged.

A step: the SchedulerOutput goes to every actor (one ``ray.put``); all run the forward together
(the collectives happen inside it); rank 0 samples and returns the output. Pipeline parallelism
(world = pipeline x tensor parallel size, stage-major): each actor runs its stage's part (hidden
states go actor to actor over torch.distributed), the last stage's tp rank 0 samples and returns
the output; ``submit`` only sends the step (its diffs carry the ids sampled since), so up to
pipeline_parallel_size steps run at once, and ``collect`` waits for the oldest. An actor runs
its steps in submission order (a sequence number; it has a thread per step in flight). Failure: each actor
also runs a ``sentinel`` call that never returns while it lives; a monitor thread waits on them,
so a worker that dies (killed, its node lost, out of memory) marks the executor dead at once --
also while idle, which the engine loop checks, so the server's /health turns 503. A step that
is running when a worker dies fails as soon as that worker's result is an error (never waiting
on the survivors, which may be stuck in a collective); then every actor is killed.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import threading
from typing import Optional

from pagedllm.core.contracts import KVTierSpec, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]' (or choose "
                         "distributed_executor_backend='mp' for ranks on this machine)") from None
    return ray


class RayWorker:
    """One rank, in its own Ray actor process (a threaded actor: ``sentinel`` holds one thread)."""

    def __init__(self) -> None:
        self.worker = None
        self.rank = -1
        self._forever = threading.Event()
        self._turn = threading.Condition()
        self._next_seq = 0  # pipeline parallel: the next step this actor runs

    def node_address(self) -> tuple[str, int]:
        """(this node's IP as Ray knows it, a free TCP port on it) for the rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def init_worker(self, config, hf_config, max_model_len: int, max_num_batched_tokens: int, rank: int,
                    world_size: int, master: tuple[str, int], local_world_size: int) -> dict:
        import torch

        from pagedllm.executor.multiproc import _agree_num_blocks, _build_worker

        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(local_world_size), LOCAL_RANK="0")
        self.rank = rank
        self.worker, self.group = _build_worker(config, hf_config, max_model_len, max_num_batched_tokens, rank,
                                                world_size)
        num_blocks = _agree_num_blocks(self.worker, self.group)
        self.worker.initialize_cache(num_blocks)
        return {"num_blocks": num_blocks, "max_model_len": self.worker.max_model_len,
                "sliding_window": self.worker.kv_sliding_window, "threads": torch.get_num_threads(),
                "weight_bytes": sum(p.numel() * p.element_size() for p in self.worker.model.parameters())}

    def execute(self, scheduler_output):
        out = self.worker.execute(scheduler_output)
        if self.rank != 0:
            return None
        return out, self.worker.runner.num_forward_tokens

    def execute_stage(self, seq: int, scheduler_output):
        """Pipeline parallelism: this rank's part of step ``seq`` (run strictly in order)."""
        from pagedllm.distributed.parallel_state import get_pp_group

        with self._turn:
            self._turn.wait_for(lambda: self._next_seq == seq)
        try:
            out = self.worker.execute(scheduler_output)
        finally:
            with self._turn:
                self._next_seq += 1
                self._turn.notify_all()
        if self.rank != get_pp_group().sampler_rank:
            return None
        return out, self.worker.runner.num_forward_tokens

    def sentinel(self) -> None:
        """Never returns while the actor lives: its failure is how the driver learns of a death."""
        self._forever.wait()

    def shutdown(self) -> None:
        import torch.distributed as dist

        from pagedllm.distributed.parallel_state import get_pp_group

        self._forever.set()
        get_pp_group().wait_sends()
        if dist.is_initialized():
            dist.destroy_process_group()


class RayExecutor:
    num_blocks: int
    max_model_len: int
    sliding_window: Optional[int]
    weight_bytes_per_rank: list[int]
    kv_tier_spec: Optional[KVTierSpec] = None  # the KV offload tier is not supported with Ray yet (config refuses it)
    max_concurrent_batches: int  # one step per pipeline stage

    def __init__(self, config, hf_config, max_model_len: int, max_num_batched_tokens: int) -> None:
        if config.pipeline_parallel_size > 1:
            from pagedllm.executor.multiproc import stage_partition

            stage_partition(config, hf_config)  # a bad pp_layer_partition fails before Ray or any actor starts
        ray = import_ray()
        self._ray = ray
        self.pp_size = self.max_concurrent_batches = config.pipeline_parallel_size
        world = config.tensor_parallel_size * self.pp_size
        self.world_size = world
        self._sampler = (self.pp_size - 1) * config.tensor_parallel_size  # the rank that returns outputs
        self._steps: collections.deque = collections.deque()  # pipeline parallel: refs of steps in flight
        self._seq = 0
        self._own_ray = not ray.is_initialized()  # joined (or started) here: left again at shutdown
        if self._own_ray:
            ray.init(ignore_reinit_error=True, log_to_driver=True)
        cpus, use_gpu = self._place_actors(config)
        self._dead_reason: Optional[str] = None
        self._closing = False
        addresses, infos = self._init_workers(dataclasses.replace(config, cpu_threads=cpus), hf_config,
                                              max_model_len, max_num_batched_tokens)
        self.num_blocks = infos[0]["num_blocks"]
        self.max_model_len = infos[0]["max_model_len"]
        self.sliding_window = infos[0]["sliding_window"]
        self.weight_bytes_per_rank = [i["weight_bytes"] for i in infos]
        self._num_forward_tokens = 0
        logger.info("Ray executor: %d workers on nodes %s, %d CPUs%s each", world, [ip for ip, _ in addresses],
                    cpus, " + 1 GPU" if use_gpu else "")
        self._sentinels = {a.sentinel.remote(): r for r, a in enumerate(self.actors)}
        self._monitor = threading.Thread(target=self._watch, name="pagedllm-ray-monitor", daemon=True)
        self._monitor.start()

    def _place_actors(self, config) -> tuple[int, bool]:
        """A placement group of one bundle per rank (PACK) and an actor in each; (CPUs per rank,
        whether each has a GPU)."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, world = self._ray, self.world_size
        use_gpu = config.device.startswith("cuda") or (config.device == "auto" and
                                                        ray.cluster_resources().get("GPU", 0) >= 1)
        total_cpus = int(ray.cluster_resources().get("CPU", 1))
        cpus = config.cpu_threads or max(1, total_cpus // world)
        bundle = {"CPU": cpus, **({"GPU": 1} if use_gpu else {})}
        self._pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self._pg)
            raise ValueError(f"the Ray cluster cannot place {world} workers of {bundle} within "
                             f"{PLACEMENT_TIMEOUT_S:.0f} s (it has {ray.cluster_resources()}); lower "
                             "tensor_parallel_size, pipeline_parallel_size or cpu_threads, or add nodes")
        actor_cls = ray.remote(RayWorker)
        self.actors = [
            actor_cls.options(num_cpus=cpus, num_gpus=1 if use_gpu else 0, max_concurrency=2 + self.pp_size,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  self._pg, placement_group_bundle_index=i)).remote()
            for i in range(self.world_size)
        ]
        return cpus, use_gpu

    def _init_workers(self, worker_config, hf_config, max_model_len: int, max_num_batched_tokens: int):
        """Every actor joins the rendezvous at rank 0's node and builds its worker; (the actors'
        (ip, port), their init_worker reports). Each rank runs ``worker_config.cpu_threads``
        threads (the CPUs Ray reserved for it; Ray does not pin cores)."""
        ray = self._ray
        try:
            addresses = ray.get([a.node_address.remote() for a in self.actors])
            per_node = {ip: sum(1 for a, _ in addresses if a == ip) for ip, _ in addresses}
            infos = ray.get([a.init_worker.remote(worker_config, hf_config, max_model_len, max_num_batched_tokens,
                                                  r, self.world_size, addresses[0], per_node[addresses[r][0]])
                             for r, a in enumerate(self.actors)])
        except Exception as e:
            self._kill()
            raise RuntimeError(f"Ray workers failed to start: {e}") from e
        return addresses, infos

    # ---- failure ------------------------------------------------------------------------------
    def _watch(self) -> None:
        ray = self._ray
        ready, _ = ray.wait(list(self._sentinels), num_returns=1, timeout=None)
        if self._closing:
            return
        rank = self._sentinels[ready[0]]
        try:
            ray.get(ready[0])
            why = "its sentinel returned"
        except Exception as e:  # RayActorError / ActorDiedError: the usual way
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self._fail(f"Ray worker rank {rank} died ({why})")

    def _fail(self, reason: str) -> None:
        if self._dead_reason is None:
            self._dead_reason = reason
            logger.error("%s; the engine cannot continue", reason)
        self._kill()

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    @property
    def dead_reason(self) -> Optional[str]:
        return self._dead_reason

    def _kill(self) -> None:
        for a in self.actors:
            try:
                self._ray.kill(a)
            except Exception:
                pass

    # ---- steps --------------------------------------------------------------------------------
    @property
    def num_forward_tokens(self) -> int:
        return self._num_forward_tokens

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.pp_size > 1:
            self.submit(scheduler_output)
            return self.collect()
        if self._dead_reason is not None:
            raise RuntimeError(f"{self._dead_reason}; the engine cannot continue")
        steps = self._put(scheduler_output, 0)
        refs = [a.execute.remote(so) for so, a in zip(steps, self.actors)]
        return self._wait_step(refs, 0)

    def _put(self, scheduler_output: SchedulerOutput, sampler: int) -> list:
        """The step in the object store, per actor: the sampling rank's with the grammar masks."""
        full = self._ray.put(scheduler_output)
        peers = full if scheduler_output.grammar is None else self._ray.put(scheduler_output.without_grammar())
        return [full if r == sampler else peers for r in range(len(self.actors))]

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Pipeline parallelism: send a step to every actor without waiting for it."""
        if self._dead_reason is not None:
            raise RuntimeError(f"{self._dead_reason}; the engine cannot continue")
        steps = self._put(scheduler_output, self._sampler)
        refs = [a.execute_stage.remote(self._seq, so) for so, a in zip(steps, self.actors)]
        self._seq += 1
        self._steps.append(refs)

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's output."""
        return self._wait_step(self._steps.popleft(), self._sampler)

    def _wait_step(self, refs: list, result_rank: int) -> ModelRunnerOutput:
        ray = self._ray
        pending, result = list(refs), None
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=None)
            try:
                value = ray.get(ready[0])
            except Exception as e:  # a worker died or raised: the ranks are out of step now
                rank = refs.index(ready[0])
                self._fail(f"Ray worker rank {rank} failed during a step ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})")
                raise RuntimeError(f"{self._dead_reason}; the engine cannot continue") from e
            if ready[0] == refs[result_rank]:
                result = value
        output, self._num_forward_tokens = result
        return output

    def idle_work(self, seconds: float) -> bool:
        return False  # the ranks' caches stay lazy (a rank runs steps only when told)

    def shutdown(self) -> None:
        ray = self._ray
        self._closing = True
        if self._dead_reason is None:
            try:
                while self._steps:  # pipeline steps still in flight: let the stages finish them
                    self.collect()
                ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
            except Exception:
                pass
        self._kill()
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
        except Exception:
            pass
        if self._own_ray:
            ray.shutdown()
