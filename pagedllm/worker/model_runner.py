"""ModelRunner: SchedulerOutput -> one flat forward over the ragged batch -> sampled tokens.

Per step: apply the scheduler's diffs to the persistent request states, build the batch tensors
once (input ids, positions, slot mapping, block table, query_start_loc, seq_lens, logits
indices) with numpy, run ONE forward, compute logits only for rows that sample, sample, and
bring the sampled ids to the host with one sync.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.core.contracts import Logprobs, ModelRunnerOutput, SchedulerOutput
from pagedllm.attention.forward_context import set_attention_metadata
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.sample.sampler import Sampler, SamplerOutput, compute_logprob_table
from pagedllm.worker.input_batch import CachedRequestState, build_block_table, build_sampling_metadata


class ModelRunner:
    def __init__(self, model, block_size: int, vocab_size: int, device: torch.device, seed: int) -> None:
        self.model = model
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler(seed, device)
        self.requests: dict[str, CachedRequestState] = {}
        # Seeded generators outlive preemption (the worker forgets a preempted request's state,
        # but its random stream must continue where it stopped).
        self.generators: dict[str, torch.Generator] = {}
        self.num_forward_tokens = 0
        self.tp = get_tp_group()  # fixed at construction: another engine in the process may differ
        self.graph_runner = None  # a DecodeGraphRunner on CUDA unless enforce_eager (set by the worker)

    # ---- state diffs ------------------------------------------------------------------------
    def _apply_diffs(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            gen = self.generators.get(nr.req_id)
            if gen is None and nr.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(nr.sampling_params.seed)
                self.generators[nr.req_id] = gen
            self.requests[nr.req_id] = CachedRequestState(
                req_id=nr.req_id,
                token_ids=list(nr.token_ids),
                num_prompt_tokens=nr.num_prompt_tokens,
                sampling_params=nr.sampling_params,
                block_ids=list(nr.block_ids),
                num_computed_tokens=nr.num_computed_tokens,
                generator=gen,
            )
        for cr in so.scheduled_cached_reqs:
            st = self.requests[cr.req_id]
            st.block_ids.extend(cr.new_block_ids)
            st.num_computed_tokens = cr.num_computed_tokens

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(so)
        if so.is_empty:
            return ModelRunnerOutput([], [])
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        n_sched = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        seq_lens = starts + n_sched
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(n_sched, out=qsl[1:])
        total = int(qsl[-1])

        input_ids: list[int] = []
        for s, a, n in zip(states, starts.tolist(), n_sched.tolist()):
            input_ids.extend(s.token_ids[a : a + n])
        req_of_token = np.repeat(np.arange(len(req_ids)), n_sched)
        positions = np.arange(total) - qsl[:-1][req_of_token] + starts[req_of_token]
        block_table = build_block_table(states)
        bs = self.block_size
        slots = block_table[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs

        # Rows that end at the request's last known token produce a sample.
        num_tokens_now = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        sample_mask = seq_lens >= num_tokens_now
        sample_idx = np.nonzero(sample_mask)[0]
        logits_indices = qsl[1:][sample_idx] - 1

        dev = self.device
        md = AttentionMetadata.from_host(qsl, seq_lens, block_table, slots, dev)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(positions).to(dev)
        graphs = self.graph_runner
        if graphs is not None and total == len(req_ids) and total <= graphs.max_batch:  # decode-only
            hidden = graphs.run(ids_t, pos_t, md.slot_mapping, md.seq_lens, md.block_table)
        else:
            with set_attention_metadata(md):
                hidden = self.model(ids_t, pos_t)
        self.num_forward_tokens += total

        prompt_lp = self._prompt_logprobs(states, req_ids, starts, n_sched, qsl, hidden)

        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, Logprobs] = {}
        if len(sample_idx):
            sample_states = [states[i] for i in sample_idx]
            logits = self.model.compute_logits(hidden[torch.from_numpy(logits_indices).to(dev)])
            tp = self.tp
            if tp.rank == 0:
                smd = build_sampling_metadata(sample_states, self.vocab_size, dev)
                out = self.sampler(logits, smd)
            else:
                out = SamplerOutput(torch.empty(len(sample_idx), dtype=torch.long), None, None, None)
            if tp.world_size > 1:  # sampled once on rank 0; every rank appends the same tokens
                ids_cpu = out.sampled.cpu()
                torch.distributed.broadcast(ids_cpu, src=0, group=tp.cpu_group)
                out.sampled = ids_cpu
            sampled = out.sampled.tolist()  # the step's one device->host sync
            if out.logprob_ids is not None:
                ids_l, vals_l, ranks_l = out.logprob_ids.tolist(), out.logprob_vals.tolist(), out.sampled_ranks.tolist()
            for j, i in enumerate(sample_idx.tolist()):
                tok = sampled[j]
                st = states[i]
                st.token_ids.append(tok)
                sampled_lists[i] = [tok]
                k = st.sampling_params.logprobs
                if k is not None:
                    logprobs[st.req_id] = Logprobs([ids_l[j][: 1 + k]], [vals_l[j][: 1 + k]], [ranks_l[j]])
        for i, st in enumerate(states):
            st.num_computed_tokens = int(seq_lens[i])
        return ModelRunnerOutput(req_ids, sampled_lists, logprobs, prompt_lp)

    def _prompt_logprobs(self, states, req_ids, starts, n_sched, qsl, hidden) -> dict[str, Logprobs]:
        """Logprobs of prompt tokens 1..P-1 covered by this step's chunk (position p predicts p+1)."""
        out: dict[str, Logprobs] = {}
        for i, st in enumerate(states):
            k = st.sampling_params.prompt_logprobs
            if k is None or st.num_output_tokens > 0:
                continue
            a = int(starts[i])
            b = min(a + int(n_sched[i]), st.num_prompt_tokens - 1)
            if b <= a:
                continue
            rows = hidden[int(qsl[i]) : int(qsl[i]) + (b - a)]
            lp = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            targets = torch.tensor(st.token_ids[a + 1 : b + 1], dtype=torch.long, device=self.device)
            ids, vals, ranks = compute_logprob_table(lp, targets, k)
            out[st.req_id] = Logprobs(ids.tolist(), vals.tolist(), ranks.tolist(), start=a)
        return out
