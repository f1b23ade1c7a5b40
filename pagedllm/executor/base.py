"""Executor: what EngineCore needs from whatever runs the model (one process, or TP ranks).

An executor owns the workers: it builds them, sizes the paged KV cache (agreeing on one block
count across ranks), runs one step per ``execute`` and returns the driver rank's output. The
implementations (``UniprocExecutor``, ``MultiprocExecutor``) satisfy this Protocol
structurally; a test checks their names and signatures against it.

Steps in flight: every executor also has ``submit(scheduler_output)`` (start a step without
waiting for it) and ``collect() -> ModelRunnerOutput`` (the oldest submitted step's output); the
engine keeps up to max_concurrent_batches steps (pipeline stages), or two under async
scheduling, in flight through them (engine/core.py).
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from pagedllm.core.contracts import KVTierSpec, ModelRunnerOutput, SchedulerOutput


@runtime_checkable
class Executor(Protocol):
    num_blocks: int  # KV cache blocks per rank (the same on every rank)
    max_model_len: int  # the context length served: lowered to what the KV cache holds unless the user set it
    sliding_window: Optional[int]  # the window every attention layer shares (blocks behind it are freed), else None
    kv_tier_spec: Optional[KVTierSpec]  # the workers' KV offload tier (slots, bytes per block), else None
    # Steps it runs at once: its pipeline stages, or an asynchronous device's queue (1: one at a
    # time); the engine keeps this many in flight through ``submit``/``collect`` when above 1.
    max_concurrent_batches: int

    @property
    def num_forward_tokens(self) -> int:
        """Tokens run through the model so far (prefill and decode), for statistics."""
        ...

    @property
    def weight_bytes_per_rank(self) -> list[int]:
        """Bytes of model parameters held by each rank, rank 0 first."""
        ...

    @property
    def is_dead(self) -> bool:
        """True once the executor cannot run another step (e.g. a TP rank died): the engine
        then fails instead of failing only the step's requests."""
        ...

    @property
    def dead_reason(self) -> Optional[str]:
        """Why it cannot run another step (e.g. which rank died); None while it can."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the result is the driver rank's (with its logprobs).
        The step's structured-output masks (``scheduler_output.grammar``) go to the sampling rank only."""
        ...

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start one step on every rank without waiting for it (``collect`` returns its output)."""
        ...

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's output (the driver rank's), waiting for it."""
        ...

    def idle_work(self, seconds: float) -> bool:
        """Work the workers do while the engine has nothing to run (the CPU KV cache's idle
        prefault), for about ``seconds``; whether any is left (False: nothing to do, or its
        workers run elsewhere)."""
        ...

    def shutdown(self) -> None:
        """Stop the other ranks and release the process group (nothing to do in one process)."""
        ...
