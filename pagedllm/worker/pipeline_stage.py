"""This rank's place in the pipeline, chosen once at construction (``pipeline_stage``): where the
step's forward ends, whether the stage samples, and how the sampled ids are shared and kept.

- ``WholeModel`` (no pipeline parallelism): the whole model runs here; the sampling rank's ids
  are broadcast to the tensor-parallel ranks, and every rank appends them to its request states;
- ``LastStage``: receives the previous stage's tensors, runs the last layers and samples (on its
  tp rank 0), but appends nothing: the scheduler sends every stage the ids sampled by earlier
  steps in the diffs of the step that schedules those requests again
  (CachedRequestData.new_token_ids), so all stages keep the same request states without waiting
  on one another;
- ``InnerStage`` (first and middle stages): runs its layers and sends their tensors on; its step
  ends there, with the computed counts advanced and no tokens.
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import torch

from pagedllm.attention.forward_context import set_attention_metadata
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.input_batch import InputBatch, StepInputs


class PipelineStageForward:
    """One pipeline stage's forward: the previous stage's tensors in, this stage's layers, out to
    the next stage (the last stage returns its final hidden states)."""

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


class StageRole(Protocol):
    samples: bool  # this stage's tp rank 0 samples
    forward: Callable[[StepInputs], torch.Tensor]  # hidden states [T, H] of every scheduled token

    def finish(self, runner, so: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
               tier: dict) -> ModelRunnerOutput: ...


class SamplingStageRole(StageRole, Protocol):
    def share_sampled(self, ids: torch.Tensor) -> torch.Tensor: ...

    def keep_sampled(self, batch: InputBatch, inputs: StepInputs, sampled: list[int]) -> None: ...


class _SamplingStage:
    """A stage whose tp rank 0 samples: the runner emits the step's tokens."""

    samples = True

    def finish(self, runner, so: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
               tier: dict) -> ModelRunnerOutput:
        return runner.emit_tokens(so, inputs, hidden, tier)


class WholeModel(_SamplingStage):
    """No pipeline parallelism: every rank appends the broadcast ids."""

    def __init__(self, forward: Callable[[StepInputs], torch.Tensor], tp) -> None:
        self.forward = forward
        self.share_sampled = tp.share_sampled  # sampled once on the sampling rank; every rank appends the same

    def keep_sampled(self, batch: InputBatch, inputs: StepInputs, sampled: list[int]) -> None:
        """Append each sampling row's id to its request's tokens and to the persistent batch."""
        if not sampled:
            return
        states, rows = inputs.states, inputs.sample_rows
        if len(rows) == len(states):  # every row sampled (decodes, last prefill chunks): the usual step
            for st, tok in zip(states, sampled):
                st.token_ids.append(tok)
        else:
            for tok, i in zip(sampled, rows.tolist()):
                states[i].token_ids.append(tok)
        batch.append_sampled(inputs.rows[rows], np.fromiter(sampled, dtype=np.int32, count=len(sampled)))


def _keep(ids: torch.Tensor) -> torch.Tensor:
    return ids


class LastStage(_SamplingStage):
    """The pipeline's last stage: samples, keeps nothing (the ids come back in the diffs)."""

    def __init__(self, forward: Callable[[StepInputs], torch.Tensor]) -> None:
        self.forward = forward
        self.share_sampled = _keep  # no broadcast: the ids reach every stage in a later step's diffs

    def keep_sampled(self, batch: InputBatch, inputs: StepInputs, sampled: list[int]) -> None:
        pass


class InnerStage:
    """A first or middle stage: its step ends when its tensors are sent on."""

    samples = False

    def __init__(self, forward: Callable[[StepInputs], torch.Tensor]) -> None:
        self.forward = forward

    def finish(self, runner, so: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
               tier: dict) -> ModelRunnerOutput:
        """The computed counts advance; no tokens (the next stage has the hidden states now)."""
        for st, n in zip(inputs.states, inputs.seq_lens.tolist()):
            st.num_computed_tokens = n
        return ModelRunnerOutput(inputs.req_ids, [[] for _ in inputs.req_ids], **tier)


def pipeline_stage(pp, tp, model, device: torch.device,
                   whole_model_forward: Callable[[StepInputs], torch.Tensor]) -> StageRole:
    """``pp``: this rank's PPGroup (world size 1: no pipeline parallelism); ``whole_model_forward``:
    the forward path without it (eager, or CUDA graphs)."""
    if pp.world_size > 1:
        forward = PipelineStageForward(model, pp, device)
        return LastStage(forward) if pp.is_last else InnerStage(forward)
    return WholeModel(whole_model_forward, tp)
