"""The model runner's plug-ins: each feature's work in the step, typed by a Protocol and given to
the ModelRunner at construction (worker/worker.py builds them; nothing is wired in afterwards).

- ``LoRAPlugin`` (lora/slots.py's LoRASlotManager): loads the adapters the scheduler put into
  slots, and tells the wrapped layers which slot each token uses for one forward;
- ``SpecPlugin`` (spec_decode/decoder.py's SpecDecoder): proposes drafts before the forward,
  verifies them instead of sampling, observes the target's hidden states after the step;
- ``GraphPlugin`` (worker/cuda_graphs.py's DecodeGraphRunner): replays a captured decode step;
- ``KVTierPlugin`` (worker/kv_tier/transfer.py's TierTransfers): the KV offload tier's stores and
  loads of the step (SchedulerOutput.kv_transfers), run first;
- the forward path without pipeline parallelism, chosen once (``whole_model_forward``):
  ``EagerForward`` (with LoRA rows) or ``GraphForward`` (decode-only steps replay a graph, others
  run eagerly); a pipeline stage's is worker/pipeline_stage.py's.
What the runner builds itself, from the rank's place: its pipeline stage role
(worker/pipeline_stage.py), its part in sampling (worker/sampling_rank.py: the sampler, the
grammar masks, logprobs) and the beam rows (worker/beam_rows.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np
import torch

from pagedllm.attention.forward_context import set_attention_metadata
from pagedllm.core.contracts import LoRAHandle
from pagedllm.worker.input_batch import StepInputs


class LoRAPlugin(Protocol):
    def load(self, slot: int, handle: LoRAHandle) -> None: ...

    def begin_step(self, token_slots: np.ndarray) -> None: ...

    def end_step(self) -> None: ...


class SpecPlugin(Protocol):
    def propose(self, runner, so): ...  # (drafts by request id or None, draft probabilities or None)

    def place_drafts(self, so, drafts, states, num_scheduled: np.ndarray, batch) -> None: ...

    def sample_or_verify(self, runner, so, inputs: StepInputs, hidden: torch.Tensor): ...

    def observe(self, runner, inputs: StepInputs, hidden: torch.Tensor) -> None: ...


class GraphPlugin(Protocol):
    @property
    def max_batch(self) -> int: ...

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor: ...


class KVTierPlugin(Protocol):
    def run(self, transfers) -> tuple[frozenset[int], float]: ...  # (device blocks whose load failed, seconds)


class NoSpec:
    """Without speculative decoding: nothing proposed, every step sampled, nothing observed."""

    def __init__(self, generator: Optional[torch.Generator] = None) -> None:
        pass

    def propose(self, runner, so):
        return None, None

    def place_drafts(self, so, drafts, states, num_scheduled: np.ndarray, batch) -> None:
        pass

    def sample_or_verify(self, runner, so, inputs: StepInputs, hidden: torch.Tensor):
        """(tokens per batch row, logprobs by request id, drafts verified per row: None)."""
        return (*runner.sample_tokens(inputs, hidden, so.grammar), None)

    def observe(self, runner, inputs: StepInputs, hidden: torch.Tensor) -> None:
        pass


class NoKVTier:
    """A worker without a KV offload tier: the scheduler never plans transfers for it."""

    def run(self, transfers):
        raise RuntimeError("the scheduler planned KV offload tier transfers but this worker has no tier")


@dataclass(frozen=True)
class RunnerPlugins:
    """What a worker gives its runner. ``spec`` is a factory: the verifier draws from the sampling
    rank's generator, which the runner creates (None on the other ranks)."""

    lora: Optional[LoRAPlugin] = None
    spec: Callable[[Optional[torch.Generator]], SpecPlugin] = NoSpec
    graphs: Optional[GraphPlugin] = None
    kv_tier: Optional[KVTierPlugin] = None
    # --logits-processors: builds the sampling rank's BatchProcessors (sample/logits_processors.py)
    logits: Optional[Callable[[], object]] = None


# ---- forward paths ------------------------------------------------------------------------------
class EagerForward:
    """One pass of the whole model over the ragged batch (LoRA rows set around it)."""

    def __init__(self, model, lora: Optional[LoRAPlugin]) -> None:
        self.model = model
        self.lora = lora

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        lora = self.lora
        if lora is not None:  # every wrapped layer's rows per adapter slot, built once
            lora.begin_step(np.repeat([s.lora_slot for s in inputs.states], inputs.num_scheduled))
        try:
            with set_attention_metadata(inputs.attn_metadata):
                if inputs.mm_embeds is not None:  # a multimodal model's image positions in this step
                    return self.model(inputs.input_ids, inputs.positions, mm_embeds=inputs.mm_embeds)
                return self.model(inputs.input_ids, inputs.positions)
        finally:
            if lora is not None:
                lora.end_step()


class GraphForward:
    """Decode-only steps (one token per request) up to the largest captured size replay a graph."""

    def __init__(self, graphs: GraphPlugin, eager: EagerForward) -> None:
        self.graphs = graphs
        self.eager = eager

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        total = inputs.num_tokens
        if total == len(inputs.req_ids) and total <= self.graphs.max_batch and inputs.mm_embeds is None:
            md = inputs.attn_metadata
            return self.graphs.run(inputs.input_ids, inputs.positions, md.slot_mapping, md.seq_lens, md.block_table)
        return self.eager(inputs)


def whole_model_forward(model, plugins: RunnerPlugins):
    """The forward path without pipeline parallelism: graphs where the worker captured them."""
    eager = EagerForward(model, plugins.lora)
    return GraphForward(plugins.graphs, eager) if plugins.graphs is not None else eager
