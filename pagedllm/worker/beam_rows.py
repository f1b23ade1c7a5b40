"""The runner's beam-search step: beam rows are scored per group (sample/beam.py), not sampled.

Rows whose state carries a BeamRow are taken out of the step's sampling rows; their logits go
through ``beam_topk`` in one batch, and each group's candidates come back as BeamCandidates
(parents named by request id) for the scheduler. Under tensor parallelism every rank computes
the logits (a collective); rank 0 alone scores, like sampling.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.contracts import BeamCandidates, Logprobs
from pagedllm.sample.beam import beam_topk
from pagedllm.worker.input_batch import StepInputs


def score_beam_rows(model, inputs: StepInputs, hidden: torch.Tensor, is_sampler: bool) -> dict[str, BeamCandidates]:
    rows = inputs.sample_rows
    if not len(rows):
        return {}
    is_beam = np.fromiter((inputs.states[i].beam is not None for i in rows.tolist()), dtype=bool, count=len(rows))
    if not is_beam.any():
        return {}
    dev = inputs.logits_indices.device
    beam_pos, keep_pos = np.nonzero(is_beam)[0], np.nonzero(~is_beam)[0]
    logit_idx = inputs.logits_indices[torch.from_numpy(beam_pos).to(dev)]
    inputs.sample_rows = rows[keep_pos]
    inputs.logits_indices = inputs.logits_indices[torch.from_numpy(keep_pos).to(dev)]
    logits = model.compute_logits(hidden[logit_idx])  # every rank (a collective under TP)
    if not is_sampler:
        return {}
    states = [inputs.states[i] for i in rows[beam_pos].tolist()]
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
