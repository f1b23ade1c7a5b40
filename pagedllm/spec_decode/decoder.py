"""SpecDecoder: what the model runner calls for speculative decoding, once per step.

``propose`` fills the draft slots the scheduler reserved (``SchedulerOutput.num_spec_slots``)
with an n-gram lookup or a draft model, before the target forward; ``verify`` turns the target's
logits at every drafted position into the accepted tokens (spec_decode/verifier.py). The
scheduler then rolls back the slots of rejected drafts.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.config import SpeculativeConfig
from pagedllm.sample.rejection_sampler import RejectionSampler
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

    def propose(self, runner, so) -> tuple[Optional[dict[str, list[int]]], Optional[torch.Tensor]]:
        """(drafts by request id, proposal probabilities [sum k, V] in batch order or None), or
        (None, None) when no request has draft slots this step (the scheduler's governor,
        spec_decode/governor.py, gives none in a plain step)."""
        gone = so.finished_req_ids | so.preempted_req_ids
        if self.ngram is not None:
            self.ngram.drop(gone)
        if self.drafter is not None:
            self.drafter.forget(gone | {nr.req_id for nr in so.scheduled_new_reqs})
        slots = so.num_spec_slots
        if not slots:
            return None, None
        if self.ngram is not None:
            states = runner.requests
            return self.ngram.propose({r: states[r].token_ids for r in slots}, slots), None
        return self.drafter.propose(runner, so, slots)

    def place_drafts(self, so, drafts, states, num_scheduled: np.ndarray, batch) -> None:
        """Before the runner gathers the step's tokens: the reserved draft slots beyond the drafts
        (all of them without drafts) stay unused, and each request's drafts are written after its
        last token, where the gather reads them (not counted as its tokens)."""
        if so.num_spec_slots:
            d = drafts or {}
            num_scheduled -= np.fromiter((so.num_spec_slots.get(s.req_id, 0) - len(d.get(s.req_id, ())) for s in states),
                                         dtype=np.int64, count=len(states))
        if drafts:
            for s in states:
                d = drafts.get(s.req_id)
                if d:
                    batch.write_tokens(s.row, len(s.token_ids), d)

    def sample_or_verify(self, runner, so, inputs, hidden):
        """(tokens per batch row, logprobs by request id, drafts verified per row or None): a step
        without drafts samples as usual; with them, every drafted position is verified at once."""
        if inputs.drafts is None:
            return (*runner.sample_tokens(inputs, hidden, so.grammar), None)
        return self.verify(runner, inputs, hidden, inputs.drafts, inputs.draft_probs)

    def verify(self, runner, inputs, hidden, drafts, draft_probs):
        return verify_and_update(runner, inputs, hidden, drafts, draft_probs, self.sampler)

    def observe(self, runner, inputs, hidden) -> None:
        """After every step (drafted or not, states updated): a proposer that drafts from the
        target's hidden states (EAGLE) takes those of the positions this step computed."""
        if self.drafter is not None:
            self.drafter.observe(runner, inputs, hidden)
