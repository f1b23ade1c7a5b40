"""SpecDecoder: what the model runner calls for speculative decoding, once per step.

``propose`` fills the draft slots the scheduler reserved (``SchedulerOutput.num_spec_slots``)
with an n-gram lookup or a draft model, before the target forward; ``verify`` turns the target's
logits at every drafted position into the accepted tokens (spec_decode/verifier.py). The
scheduler then rolls back the slots of rejected drafts.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.config import SpeculativeConfig
from pagedllm.sample.rejection_sampler import RejectionSampler
from pagedllm.spec_decode.governor import SpecGovernor
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.verifier import verify_and_update


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, generator: Optional[torch.Generator], drafter=None) -> None:
        """``generator``: the sampling rank's engine generator (None on other TP ranks);
        ``drafter``: a DraftModelProposer for method "draft_model", an EagleProposer for "eagle"."""
        self.config = config
        self.ngram = (NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.drafter = drafter
        self.sampler = RejectionSampler(generator) if generator is not None else None
        self.governor = SpecGovernor() if config.auto_disable else None

    def propose(self, runner, so) -> tuple[Optional[dict[str, list[int]]], Optional[torch.Tensor]]:
        """(drafts by request id, proposal probabilities [sum k, V] in batch order or None), or
        (None, None) when no request has draft slots this step or the governor says speculation
        loses (the reserved slots then stay unused: a plain decode step)."""
        gone = so.finished_req_ids | so.preempted_req_ids
        if self.ngram is not None:
            self.ngram.drop(gone)
        if self.drafter is not None:
            self.drafter.forget(gone | {nr.req_id for nr in so.scheduled_new_reqs})
        decode_only = 0 < len(so.num_spec_slots) == len(so.num_scheduled_tokens)
        speculate = self.governor.begin_step(decode_only) if self.governor is not None else True
        slots = so.num_spec_slots
        if slots and not speculate:
            # A seeded request keeps speculating: how many uniforms its stream gives up per step
            # must not depend on the governor's timing, or a rerun would sample other tokens.
            slots = {r: n for r, n in slots.items() if runner.requests[r].sampling_params.seed is not None}
        if not slots:
            return None, None
        if self.ngram is not None:
            states = runner.requests
            return self.ngram.propose({r: states[r].token_ids for r in slots}, slots), None
        return self.drafter.propose(runner, so, slots)

    def verify(self, runner, inputs, hidden, drafts, draft_probs):
        tokens, logprobs, num_drafts = verify_and_update(runner, inputs, hidden, drafts, draft_probs, self.sampler)
        if self.governor is not None and self.governor.speculate and len(inputs.sample_rows):
            self.governor.record_tokens(sum(len(tokens[i]) for i in inputs.sample_rows.tolist())
                                        / len(inputs.sample_rows))
        return tokens, logprobs, num_drafts

    def observe(self, runner, inputs, hidden) -> None:
        """After every step (drafted or not, states updated): a proposer that drafts from the
        target's hidden states (EAGLE) takes those of the positions this step computed."""
        if self.drafter is not None and hasattr(self.drafter, "observe"):
            self.drafter.observe(runner, inputs, hidden)
