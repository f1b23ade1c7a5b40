"""The runner's beam-search step: beam rows are scored per group (sample/beam.py), not sampled.

``BeamRows`` is the runner's beam plug-in: it counts the held rows that are beams (a step
without any skips the per-row pass), applies the scheduler's copy-on-write block copies, and
takes the beam rows out of the step's sampling rows; their logits go through ``beam_topk`` in
one batch (``score_beams``, on the sampling rank), and each group's candidates come back as
BeamCandidates (parents named by request id) for the scheduler. Under tensor parallelism every
rank computes the logits (a collective); the sampling rank alone scores, like sampling.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.block_copy import copy_blocks, layer_cache_planes
from pagedllm.core.contracts import BeamCandidates, Logprobs
from pagedllm.sample.beam import beam_topk
from pagedllm.worker.input_batch import StepInputs


class BeamRows:
    def __init__(self, model) -> None:
        self.model = model
        self.num_rows = 0  # held requests that are beams of a beam search

    def add(self, beam) -> None:
        self.num_rows += beam is not None

    def remove(self, beam) -> None:
        self.num_rows -= beam is not None

    def copy_blocks(self, copies) -> None:
        """Beam search copy-on-write (``SchedulerOutput.block_copies``), before any K/V is written."""
        if copies:
            copy_blocks(layer_cache_planes(self.model.attention_layers()), copies)

    def score(self, inputs: StepInputs, hidden: torch.Tensor, sampling) -> dict[str, BeamCandidates]:
        """Takes the beam rows out of ``inputs``' sampling rows; ``sampling`` (worker/sampling_rank.py)
        scores them. Every rank computes their logits."""
        if not self.num_rows:
            return {}
        rows = inputs.sample_rows
        is_beam = np.fromiter((inputs.states[i].beam is not None for i in rows.tolist()), dtype=bool, count=len(rows))
        if not is_beam.any():
            return {}
        dev = inputs.logits_indices.device
        beam_pos, keep_pos = np.nonzero(is_beam)[0], np.nonzero(~is_beam)[0]
        logit_idx = inputs.logits_indices[torch.from_numpy(beam_pos).to(dev)]
        inputs.sample_rows = rows[keep_pos]
        inputs.logits_indices = inputs.logits_indices[torch.from_numpy(keep_pos).to(dev)]
        logits = self.model.compute_logits(hidden[logit_idx])  # every rank (a collective under TP)
        return sampling.score_beams(logits, [inputs.states[i] for i in rows[beam_pos].tolist()])


def score_beams(logits: torch.Tensor, states: list) -> dict[str, BeamCandidates]:
    """Each beam group's candidates from its rows' ``logits`` (the rows of ``states``, in order)."""
    dev = logits.device
    group_ids: dict[str, int] = {}
    groups, slots, cums = [], [], []
    counts: list[int] = []
    for st in states:
        g = group_ids.setdefault(st.beam.group_id, len(group_ids))
        if g == len(counts):
            counts.append(0)
        groups.append(g)
        slots.append(counts[g])
        counts[g] += 1
        cums.append(st.beam.cum_logprob)
    first = {}
    for j, st in enumerate(states):
        first.setdefault(groups[j], st)
    k = max(st.beam.num_candidates for st in states)
    n_lp = [first[g].sampling_params.logprobs for g in range(len(counts))]
    num_logprobs = max((n for n in n_lp if n is not None), default=None)
    top = beam_topk(logits, torch.tensor(groups, device=dev), torch.tensor(slots, device=dev),
                    torch.tensor(cums, dtype=torch.float32, device=dev), len(counts), max(counts), k, num_logprobs)
    out: dict[str, BeamCandidates] = {}
    for gid, g in group_ids.items():
        kg = first[g].beam.num_candidates
        kg = min(kg, sum(1 for r in top.rows[g][:kg] if r >= 0))  # only real beams (a tiny vocabulary)
        parents = [states[r].req_id for r in top.rows[g][:kg]]
        lp = None
        if n_lp[g] is not None and top.logprob_ids is not None:
            w = 1 + n_lp[g]
            lp = Logprobs([ids[:w] for ids in top.logprob_ids[g][:kg]], [v[:w] for v in top.logprob_vals[g][:kg]],
                          top.logprob_ranks[g][:kg])
        out[gid] = BeamCandidates(parents, top.tokens[g][:kg], top.scores[g][:kg], lp)
    return out
