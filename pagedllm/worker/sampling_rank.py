"""This rank's part in sampling, chosen once at construction (``sampling_rank``).

One rank samples: tensor-parallel rank 0 of the last pipeline stage (of the only stage without
pipeline parallelism). It holds the Sampler, the --logits-processors and the seeded generators,
applies the step's grammar masks, builds the logprob tables and scores the beams. Every other
rank is a ``NonSamplingRank``: it takes part in the collectives the runner runs on every rank
(the logits) and gets the sampled ids from the one broadcast, but samples nothing and reports no
logprobs and no beam candidates.

``sample`` ends with the step's one device->host sync: ``share`` (the stage's way to share the
sampled ids: the TP broadcast, or keeping them on a pipeline's last stage) then ``tolist``.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from pagedllm.core.contracts import BeamCandidates, Logprobs
from pagedllm.sample.metadata import build_sampling_metadata, greedy_metadata
from pagedllm.sample.sampler import Sampler, compute_logprob_table
from pagedllm.worker.beam_rows import score_beams
from pagedllm.worker.input_batch import StepInputs


class SamplingRank:
    """The rank that samples (see the module docstring)."""

    def __init__(self, seed: int, device: torch.device, vocab_size: int,
                 logits_processors: Optional[Callable[[], object]]) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.sampler = Sampler(seed, device)
        self.generator: Optional[torch.Generator] = self.sampler.generator  # the engine's (unseeded rows, drafters)
        self.logits_procs = logits_processors() if logits_processors is not None else None
        # Seeded generators outlive preemption (the worker forgets a preempted request's state,
        # but its random stream must continue where it stopped).
        self.generators: dict[str, torch.Generator] = {}

    def generator_for(self, req_id: str, seed: Optional[int]) -> Optional[torch.Generator]:
        """The request's own generator: kept from before a preemption, else made from its seed."""
        gen = self.generators.get(req_id)
        if gen is None and seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[req_id] = gen
        return gen

    def forget(self, req_id: str) -> None:
        self.generators.pop(req_id, None)

    def sample(self, logits: torch.Tensor, inputs: StepInputs, plain_greedy: np.ndarray, grammar,
               share: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[int], dict[str, Logprobs]]:
        """(sampled id per sampling row, logprobs by request id). ``plain_greedy``: per batch row
        (InputBatch's); ``grammar``: the step's structured-output masks or None."""
        rows = inputs.sample_rows
        is_plain = plain_greedy[inputs.rows[rows]].all()  # the usual batch: nothing to build per row
        procs = self.logits_procs
        sample_states: list = []
        if not is_plain or grammar is not None or procs is not None:
            sample_states = [inputs.states[i] for i in rows]
        if procs is not None:  # --logits-processors: told this step's rows first
            procs.update(sample_states)
        md = greedy_metadata() if is_plain else build_sampling_metadata(sample_states, self.vocab_size, self.device)
        md.batch_processors = procs
        if grammar is not None:
            self._attach_grammar(md, sample_states, grammar)
        out = self.sampler(logits, md)
        sampled = share(out.sampled).tolist()  # the step's one device->host sync
        if out.logprob_ids is None:
            return sampled, {}
        ids_l, vals_l, ranks_l = out.logprob_ids.tolist(), out.logprob_vals.tolist(), out.sampled_ranks.tolist()
        logprobs: dict[str, Logprobs] = {}
        for j, st in enumerate(sample_states):
            k = st.sampling_params.logprobs
            if k is not None:
                logprobs[st.req_id] = Logprobs([ids_l[j][: 1 + k]], [vals_l[j][: 1 + k]], [ranks_l[j]])
        return sampled, logprobs

    def _attach_grammar(self, md, sample_states, grammar) -> None:
        """The bitmask rows of the constrained sampling rows, in row order (one gather)."""
        pairs = [(j, grammar.rows[st.req_id]) for j, st in enumerate(sample_states) if st.req_id in grammar.rows]
        if pairs:
            md.mask_rows = torch.tensor([j for j, _ in pairs], dtype=torch.long, device=self.device)
            md.mask_bits = grammar.bitmask[torch.tensor([r for _, r in pairs], dtype=torch.long)].to(self.device)
            if md.ban_rows is not None:  # min_tokens never holds back a grammar's end (it would leave no token)
                keep = ~torch.isin(md.ban_rows, md.mask_rows)
                md.ban_rows, md.ban_cols = (md.ban_rows[keep], md.ban_cols[keep]) if keep.any() else (None, None)

    def prompt_logprobs(self, logits: torch.Tensor, token_ids: list[int], a: int, b: int, k: int
                        ) -> Optional[Logprobs]:
        """The table of prompt tokens a+1..b, predicted by positions a..b-1 (``logits``)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(token_ids[a + 1 : b + 1], dtype=torch.long, device=self.device)
        ids, vals, ranks = compute_logprob_table(lp, targets, k)
        return Logprobs(ids.tolist(), vals.tolist(), ranks.tolist(), start=a)

    def score_beams(self, logits: torch.Tensor, states: list) -> dict[str, BeamCandidates]:
        return score_beams(logits, states)


class NonSamplingRank:
    """Every other rank: the sampled ids come from the broadcast; no logprobs, no beam candidates."""

    generator: Optional[torch.Generator] = None

    def generator_for(self, req_id: str, seed: Optional[int]) -> None:
        return None

    def forget(self, req_id: str) -> None:
        pass

    def sample(self, logits: torch.Tensor, inputs: StepInputs, plain_greedy: np.ndarray, grammar,
               share: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[int], dict[str, Logprobs]]:
        return share(torch.empty(len(inputs.sample_rows), dtype=torch.long)).tolist(), {}

    def prompt_logprobs(self, logits: torch.Tensor, token_ids: list[int], a: int, b: int, k: int) -> None:
        return None

    def score_beams(self, logits: torch.Tensor, states: list) -> dict[str, BeamCandidates]:
        return {}


def sampling_rank(tp, stage, seed: int, device: torch.device, vocab_size: int,
                  logits_processors: Optional[Callable[[], object]]) -> SamplingRank | NonSamplingRank:
    """``tp``: this rank's TPGroup; ``stage``: its pipeline stage role (worker/pipeline_stage.py)."""
    if tp.rank == 0 and stage.samples:
        return SamplingRank(seed, device, vocab_size, logits_processors)
    return NonSamplingRank()
