"""Tensor- and pipeline-parallel group state. With size 1 every collective is the identity.

Rank layout (world = pipeline_parallel_size x tensor_parallel_size), stage-major: global rank
``stage * tp + tp_rank``. The ranks of one stage form its tensor-parallel group; a stage sends
its intermediate tensors point-to-point to the rank with the same tp_rank in the next stage.
"""
from __future__ import annotations

import pickle
from typing import Optional, Sequence

import torch


class TPGroup:
    def __init__(self, rank: int = 0, world_size: int = 1, group=None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.cpu_group = group
        self.world_cpu_group = group  # every rank, all stages (== cpu_group without pipeline parallelism)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def share_sampled(self, ids: torch.Tensor) -> torch.Tensor:
        """The one broadcast of sampled ids: rank 0 (the sampling rank) sampled ``ids`` (any shape,
        long); every rank gets them, on the host (the gloo group), so all append the same tokens."""
        if self.world_size == 1:
            return ids
        import torch.distributed as dist

        ids = ids.cpu()
        dist.broadcast(ids, src=0, group=self.cpu_group)
        return ids

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_tp = TPGroup()


def get_tp_group() -> TPGroup:
    return _tp


def set_tp_group(group: TPGroup) -> None:
    global _tp
    _tp = group


def layer_partition(num_layers: int, num_stages: int, explicit: Optional[Sequence[int]] = None) -> list[int]:
    """Decoder layers per pipeline stage. ``explicit``: the counts as given (validated). Else an
    even split; the remainder r (< num_stages) goes one layer each to stages 0..r-1, so the
    last stage, which also runs the final norm, the LM head and sampling, never gets an extra."""
    if explicit:
        counts = [int(c) for c in explicit]
        if len(counts) != num_stages:
            raise ValueError(f"pp_layer_partition {counts} has {len(counts)} stages but pipeline_parallel_size is "
                             f"{num_stages}")
        if min(counts) < 1:
            raise ValueError(f"pp_layer_partition {counts}: every stage needs at least 1 layer")
        if sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition {counts} sums to {sum(counts)}, but the model has {num_layers} "
                             "layers (num_hidden_layers)")
        return counts
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


class PPGroup:
    """This rank's pipeline stage: its layer range, its neighbours, and the point-to-point sends
    of intermediate tensors (non-blocking: a send's buffers are kept until it completes, so a
    stage never waits on the next one) and of the sampled output (last stage -> rank 0)."""

    def __init__(self, stage: int = 0, num_stages: int = 1, partition: Optional[Sequence[int]] = None,
                 tp_size: int = 1, global_rank: int = 0, out_group=None) -> None:
        self.rank = stage
        self.world_size = num_stages
        self.partition = list(partition) if partition else None
        self.tp_size = tp_size
        self.global_rank = global_rank
        self.global_world = num_stages * tp_size
        self.out_group = out_group  # gloo group {0, sampler_rank}: the sampled outputs
        self._pending: list = []  # (work, tensors) of sends not known to be complete

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def sampler_rank(self) -> int:
        """The global rank that samples: tp rank 0 of the last stage."""
        return (self.world_size - 1) * self.tp_size

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of this stage's decoder layers."""
        if self.world_size == 1:
            return 0, num_layers
        counts = self.partition or layer_partition(num_layers, self.world_size)
        if sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition {counts} does not sum to the model's {num_layers} layers")
        start = sum(counts[: self.rank])
        return start, start + counts[self.rank]

    def _prune(self) -> None:
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def send_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """To the same tp rank of the next stage, in order."""
        import torch.distributed as dist

        self._prune()
        for t in tensors:
            t = t.contiguous()
            self._pending.append((dist.isend(t, self.global_rank + self.tp_size), t))

    def recv_tensors(self, shapes: Sequence[tuple], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """From the same tp rank of the previous stage (blocks: the stage needs them)."""
        import torch.distributed as dist

        out = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, self.global_rank - self.tp_size)
            out.append(t)
        return out

    def send_object(self, obj, dst: int = 0) -> None:
        """A picklable object (the step's ModelRunnerOutput) to ``dst`` over the output group."""
        import torch.distributed as dist

        self._prune()
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        for t in (size, data):
            self._pending.append((dist.isend(t, dst, group=self.out_group), t))

    def recv_object(self, src: int):
        import torch.distributed as dist

        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, src, group=self.out_group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src, group=self.out_group)
        return pickle.loads(data.numpy().tobytes())

    def wait_sends(self, timeout_s: float = 5.0) -> None:
        """Best effort at shutdown: sends whose receiver is gone are dropped."""
        import time

        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            self._prune()
            time.sleep(0.01)
        self._pending.clear()


_pp = PPGroup()


def get_pp_group() -> PPGroup:
    return _pp


def set_pp_group(group: PPGroup) -> None:
    global _pp
    _pp = group


JOINED_KEY = "pagedllm/joined"  # ranks > 0 add 1 to it in the rendezvous store once connected


def join_store(port: int, world_size: int, timeout_s: float = 120.0, host: str = "127.0.0.1"):
    """A rank > 0's client of the rendezvous store rank 0 serves (``serve_store``), counted in
    as joined."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(host, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))
    store.add(JOINED_KEY, 1)
    return store


def serve_store(world_size: int, timeout_s: float = 120.0, host: str = "127.0.0.1"):
    """Rank 0's rendezvous store on a port of its own (``store.port``): a fresh one per engine,
    gone with it."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def wait_for_ranks(store, procs: Sequence, timeout_s: float, poll_s: float = 0.05) -> None:
    """Until every rank process in ``procs`` (ranks 1..) has joined ``store``; a rank that exits
    first, or a ``timeout_s`` that passes, fails with a RuntimeError naming the ranks."""
    import time

    deadline = time.monotonic() + timeout_s
    while store.add(JOINED_KEY, 0) < len(procs):
        dead = [(r, p.exitcode) for r, p in enumerate(procs, start=1) if not p.is_alive()]
        if dead:
            raise RuntimeError("the engine's worker processes did not start: " + ", ".join(
                f"rank {r} exited (code {c}) before joining the process group" for r, c in dead))
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(procs) - store.add(JOINED_KEY, 0)} of the engine's {len(procs)} worker ranks "
                               f"did not join the process group within {timeout_s:g} s")
        time.sleep(poll_s)


def init_distributed(rank: int, world_size: int, device: torch.device, timeout_s: float = 120.0,
                     pp_size: int = 1, pp_partition: Optional[Sequence[int]] = None, store=None) -> TPGroup:
    """torch.distributed over ``store`` (the rendezvous store of one engine: ``serve_store`` /
    ``join_store``) or, without one, the env:// rendezvous (MASTER_ADDR/MASTER_PORT set by
    torchrun across nodes). gloo on CPU, NCCL on GPU. With ``pp_size`` > 1 the world splits into
    pp_size stages of world_size / pp_size TP ranks. Returns this rank's TP group; its
    ``world_cpu_group`` spans every rank (control messages)."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if store is not None:
        if dist.is_initialized():
            raise RuntimeError("a process group from an earlier engine is still up in this process")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    elif not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    # Control messages (pickled SchedulerOutputs, sampled ids) always travel over gloo on the CPU.
    world_cpu = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    if pp_size == 1:
        group = TPGroup(rank, world_size, dist.group.WORLD)
        group.cpu_group = world_cpu
        set_pp_group(PPGroup())
    else:
        tp = world_size // pp_size
        stage, tp_rank = divmod(rank, tp)
        group = None
        for s in range(pp_size):  # every rank creates every group, in the same order
            ranks = list(range(s * tp, (s + 1) * tp))
            g = dist.new_group(ranks)
            g_cpu = dist.new_group(ranks, backend="gloo") if backend != "gloo" else g
            if s == stage:
                group = TPGroup(tp_rank, tp, g)
                group.cpu_group = g_cpu
        out_group = dist.new_group([0, (pp_size - 1) * tp], backend="gloo")
        set_pp_group(PPGroup(stage, pp_size, pp_partition, tp, rank, out_group))
    group.world_cpu_group = world_cpu
    set_tp_group(group)
    return group
