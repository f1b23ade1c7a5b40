"""The model runner's plug-ins: each feature's work in the step, typed by a Protocol and given to
the ModelRunner at construction (worker/worker.py builds them; nothing is wired in afterwards).

- ``LoRAPlugin`` (lora/slots.py's LoRASlotManager): loads the adapters the scheduler put into
  slots, and tells the wrapped layers which slot each token uses for one forward;
- ``SpecPlugin`` (spec_decode/decoder.py's SpecDecoder): proposes drafts before the forward,
  verifies them instead of sampling, observes the target's hidden states after the step;
- ``GraphPlugin`` (worker/cuda_graphs.py's DecodeGraphRunner): replays a captured decode step;
- ``KVTierPlugin`` (worker/kv_tier/transfer.py's TierTransfers): the KV offload tier's stores and
  loads of the step (SchedulerOutput.kv_transfers), run first;
- the forward path, chosen once: ``EagerForward`` (with LoRA rows), ``GraphForward`` (decode-only
  steps replay a graph, others run eagerly) or ``PipelineStageForward`` (receive the previous
  stage's tensors, run this stage's layers, send them on).
Beam scoring (worker/beam_rows.py) and grammar masks need no plug-in: they follow the rows'
state (a BeamRow) and the step's bitmask (SchedulerOutput.grammar).
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

    def verify(self, runner, inputs: StepInputs, hidden: torch.Tensor, drafts, draft_probs): ...

    def observe(self, runner, inputs: StepInputs, hidden: torch.Tensor) -> None: ...


class GraphPlugin(Protocol):
    @property
    def max_batch(self) -> int: ...

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor: ...


class KVTierPlugin(Protocol):
    def run(self, transfers) -> tuple[frozenset[int], float]: ...  # (device blocks whose load failed, seconds)


class NoSpec:
    """Without speculative decoding: nothing proposed, nothing observed."""

    def propose(self, runner, so):
        return None, None

    def verify(self, runner, inputs: StepInputs, hidden: torch.Tensor, drafts, draft_probs):
        raise RuntimeError("no speculative decoding: nothing to verify")

    def observe(self, runner, inputs: StepInputs, hidden: torch.Tensor) -> None:
        pass


@dataclass(frozen=True)
class RunnerPlugins:
    """What a worker gives its runner. ``spec`` is a factory: the verifier draws from the sampling
    rank's generator, which the runner creates (None on the other ranks)."""

    lora: Optional[LoRAPlugin] = None
    spec: Optional[Callable[[Optional[torch.Generator]], SpecPlugin]] = None
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


class PipelineStageForward:
    """One pipeline stage: the previous stage's tensors in, this stage's layers, out to the next
    stage (the last stage returns its final hidden states)."""

    def __init__(self, model, pp, device: torch.device) -> None:
        self.model = model
        self.pp = pp
        self.device = device
        self.hidden_size = getattr(model, "pp_hidden_size", None) or model.config.hidden_size
        self.dtype = next(model.parameters()).dtype

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        pp, total = self.pp, inputs.num_tokens
        intermediate = None
        if not pp.is_first:
            intermediate = pp.recv_tensors([(total, self.hidden_size)] * self.model.pp_num_intermediate, self.dtype,
                                           self.device)
        kw = {"mm_embeds": inputs.mm_embeds} if inputs.mm_embeds is not None else {}  # the first stage's images
        with set_attention_metadata(inputs.attn_metadata):
            out = self.model(inputs.input_ids, inputs.positions, intermediate, **kw)
        if not pp.is_last:
            pp.send_tensors(out)
        return out
