"""ModelRunner: SchedulerOutput -> one flat forward over the ragged batch -> sampled tokens.

One step, in named parts (``execute``):
 1. apply the scheduler's diffs to the persistent request states;
 2. prepare inputs: the batch tensors, built once with numpy (input ids, positions, slot
    mapping, block table, query_start_loc, seq_lens, logits indices) and AttentionMetadata;
 3. forward: ONE pass over the ragged batch;
 4. sample: logits only for the rows that sample; the sampled ids reach the host with the
    step's one device->host sync;
 5. update states: append the sampled ids and advance num_computed_tokens.

Under tensor parallelism every rank runs every part (the forward and the LM head are
collectives) but only rank 0 samples: it broadcasts the sampled ids, so every rank appends the
same tokens and keeps identical request states, and every rank returns the same request ids
and sampled ids. Logprobs (sampled and prompt) are rank 0's alone: the engine reads rank 0's
output, ranks > 0 drop theirs. Seeded generators likewise live on rank 0 only.

Under pipeline parallelism a stage runs its own layers: it receives the previous stage's
intermediate tensors before its forward and sends its own to the next stage after it; only tp
rank 0 of the last stage samples, and it appends nothing: the scheduler sends every stage the
ids sampled by earlier steps in the diffs of the step that schedules those requests again
(CachedRequestData.new_token_ids), so all stages keep the same request states without waiting
on one another.

Each feature's part of the step is a plug-in given at construction (worker/runner_plugins.py):
LoRA, speculative decoding and CUDA graphs; the forward path (eager, graphs, pipeline stage) is
chosen once there too.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.block_copy import copy_blocks, layer_cache_planes
from pagedllm.core.contracts import Logprobs, ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group
from pagedllm.sample.metadata import build_sampling_metadata, greedy_metadata, is_plain_greedy
from pagedllm.sample.sampler import Sampler, SamplerOutput, compute_logprob_table
from pagedllm.worker.beam_rows import score_beam_rows
from pagedllm.worker.encoder_cache import EncoderCache
from pagedllm.worker.input_batch import CachedRequestState, InputBatch, StepInputs
from pagedllm.worker.runner_plugins import (
    EagerForward,
    GraphForward,
    NoSpec,
    PipelineStageForward,
    RunnerPlugins,
)


def _keep(ids: torch.Tensor) -> torch.Tensor:
    return ids


class ModelRunner:
    def __init__(self, model, block_size: int, vocab_size: int, device: torch.device, seed: int,
                 plugins: RunnerPlugins = RunnerPlugins()) -> None:
        self.model = model
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.tp = get_tp_group()  # fixed at construction: another engine in the process may differ
        pp = get_pp_group()
        self.pp = pp if pp.world_size > 1 else None  # this pipeline stage (None: no pipeline parallelism)
        # the one rank that samples and computes logprobs
        self.is_sampler = self.tp.rank == 0 and (self.pp is None or self.pp.is_last)
        self.sampler = Sampler(seed, device) if self.is_sampler else None
        self.logits_procs = plugins.logits() if plugins.logits is not None and self.is_sampler else None
        self.requests: dict[str, CachedRequestState] = {}
        self.batch = InputBatch()  # every held request's row: block ids, sampling facts (kept across steps)
        self.block_table = self.batch.block_table
        # Seeded generators outlive preemption (the worker forgets a preempted request's state,
        # but its random stream must continue where it stopped).
        self.generators: dict[str, torch.Generator] = {}
        # held requests that are beams of a beam search (scored, not sampled), and that want prompt
        # logprobs: a step without any skips their per-row passes
        self._num_beam_rows = self._num_prompt_logprob_rows = 0
        self.num_forward_tokens = 0
        self.lora = plugins.lora
        self.kv_tier = plugins.kv_tier
        self.spec = plugins.spec(self.sampler.generator if self.sampler else None) if plugins.spec else NoSpec()
        eager = EagerForward(model, self.lora)
        self._forward_path = (PipelineStageForward(model, self.pp, device) if self.pp is not None
                              else GraphForward(plugins.graphs, eager) if plugins.graphs is not None else eager)
        # pipeline parallelism: every stage gets the sampled ids in the diffs (new_token_ids)
        self._share_sampled = self.tp.share_sampled if self.pp is None else _keep
        self._ends_at_stage = self.pp is not None and not self.pp.is_last  # the next stage goes on
        # a multimodal model: its requests' images and the encoder outputs their prefill still needs
        self.encoder_cache = EncoderCache(model, device) if getattr(model, "supports_multimodal", False) else None

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """prepare -> forward -> sample / verify / score -> update. ``so.grammar``: the step's
        structured-output masks (on the sampling rank)."""
        tier = self._run_kv_transfers(so)  # the KV offload tier first: stores read blocks this step reuses
        self._apply_diffs(so)
        if so.is_empty:
            return ModelRunnerOutput([], [], **tier)
        drafts, draft_probs = self.spec.propose(self, so)
        inputs = self._prepare_inputs(so, drafts)
        hidden = self._forward(inputs)
        if self._ends_at_stage:  # the next stage has the hidden states now
            self._update_states(inputs, [])
            return ModelRunnerOutput(inputs.req_ids, [[] for _ in inputs.req_ids], **tier)
        # before the states grow
        prompt_logprobs = self._prompt_logprobs(inputs, hidden) if self._num_prompt_logprob_rows else {}
        # takes the beam rows out of sampling
        beams = score_beam_rows(self.model, inputs, hidden, self.is_sampler) if self._num_beam_rows else {}
        num_drafts = None
        if drafts is not None:  # speculative decoding: every drafted position verified at once
            sampled_lists, logprobs, num_drafts = self.spec.verify(self, inputs, hidden, drafts, draft_probs)
        else:
            sampled, logprobs = self._sample(inputs, hidden, so.grammar)
            sampled_lists = self._update_states(inputs, sampled)
        self.spec.observe(self, inputs, hidden)  # EAGLE: the target's hidden states of the computed positions
        return ModelRunnerOutput(inputs.req_ids, sampled_lists, logprobs, prompt_logprobs,
                                 num_draft_tokens=num_drafts, beam_candidates=beams, **tier)

    def _run_kv_transfers(self, so: SchedulerOutput) -> dict:
        """The step's KV offload tier moves; the output fields reporting them (none without)."""
        if not so.kv_transfers:
            return {}
        if self.kv_tier is None:
            raise RuntimeError("the scheduler planned KV offload tier transfers but this worker has no tier")
        failed, seconds = self.kv_tier.run(so.kv_transfers)
        return {"failed_kv_loads": failed, "kv_transfer_seconds": seconds}

    # ---- 1. state diffs ---------------------------------------------------------------------
    def _apply_diffs(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self._drop(rid)
            self.generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            self._drop(rid)
        for slot, handle in so.lora_loads:  # adapters the scheduler put into slots for this step
            self.lora.load(slot, handle)
        if so.block_copies:  # beam search copy-on-write, before any K/V is written
            copy_blocks(layer_cache_planes(self.model.attention_layers()), so.block_copies)
        for nr in so.scheduled_new_reqs:
            gen = self.generators.get(nr.req_id)
            if gen is None and nr.sampling_params.seed is not None and self.is_sampler:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(nr.sampling_params.seed)
                self.generators[nr.req_id] = gen
            self._drop(nr.req_id)  # a beam is sent in full every step
            self.requests[nr.req_id] = CachedRequestState(
                req_id=nr.req_id,
                token_ids=list(nr.token_ids),
                num_prompt_tokens=nr.num_prompt_tokens,
                sampling_params=nr.sampling_params,
                table=self.block_table,
                row=self.batch.add(nr.block_ids, is_plain_greedy(nr.sampling_params) and nr.beam is None, nr.token_ids),
                num_computed_tokens=nr.num_computed_tokens,
                generator=gen,
                beam=nr.beam,
                lora_slot=nr.lora_slot,
            )
            if nr.mm_features and self.encoder_cache is not None:
                self.encoder_cache.add(nr.req_id, nr.mm_features)
            self._num_beam_rows += nr.beam is not None
            self._num_prompt_logprob_rows += nr.sampling_params.prompt_logprobs is not None
        table = self.block_table
        for cr in so.scheduled_cached_reqs:
            st = self.requests[cr.req_id]
            if cr.new_token_ids:  # pipeline parallelism: ids sampled by earlier steps
                st.token_ids.extend(cr.new_token_ids)
                self.batch.append_tokens(st.row, cr.new_token_ids)
            if cr.new_block_ids or cr.num_dropped_block_ids:  # dropped: blocks of rejected drafts went back
                table.append(st.row, cr.new_block_ids, cr.num_dropped_block_ids)
            st.num_computed_tokens = cr.num_computed_tokens

    def _drop(self, req_id: str) -> None:
        st = self.requests.pop(req_id, None)
        if st is not None:
            self.batch.remove(st.row)
            self._num_beam_rows -= st.beam is not None
            self._num_prompt_logprob_rows -= st.sampling_params.prompt_logprobs is not None
        if self.encoder_cache is not None:
            self.encoder_cache.drop(req_id)

    # ---- 2. prepare inputs ------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput, drafts: Optional[dict[str, list[int]]] = None) -> StepInputs:
        """``drafts``: speculative tokens per request, run after its last token (their reserved
        slots beyond the drafts stay unused)."""
        req_ids = list(so.num_scheduled_tokens)
        requests, batch = self.requests, self.batch
        states = [requests[r] for r in req_ids]
        n_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        if so.num_spec_slots:  # reserved draft slots beyond the drafts (all of them without drafts) stay unused
            d = drafts or {}
            n_sched -= np.fromiter((so.num_spec_slots.get(r, 0) - len(d.get(r, ())) for r in req_ids),
                                   dtype=np.int64, count=len(req_ids))
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        seq_lens = starts + n_sched
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(n_sched, out=qsl[1:])
        total = int(qsl[-1])

        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        if drafts:  # run after the request's last token: written where the gather reads them (not counted)
            for s in states:
                d = drafts.get(s.req_id)
                if d:
                    batch.write_tokens(s.row, len(s.token_ids), d)
        req_of_token = np.repeat(np.arange(len(req_ids)), n_sched)
        positions = np.arange(total) - qsl[:-1][req_of_token] + starts[req_of_token]
        input_ids = batch.token_ids[rows[req_of_token], positions]  # the persistent token rows: one gather
        block_table = self.block_table.gather(rows)
        bs = self.block_size
        slots = block_table[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs

        # Rows that end at the request's last known token produce a sample.
        sample_rows = np.nonzero(seq_lens >= batch.num_tokens[rows])[0]
        logits_indices = qsl[1:][sample_rows] - 1

        dev = self.device
        mm = None if self.encoder_cache is None else self.encoder_cache.step_embeds(req_ids, starts, n_sched, qsl)
        return StepInputs(
            req_ids=req_ids,
            states=states,
            rows=rows,
            starts=starts,
            num_scheduled=n_sched,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            input_ids=torch.from_numpy(input_ids.astype(np.int64)).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            attn_metadata=AttentionMetadata.from_host(qsl, seq_lens, block_table, slots, dev),
            sample_rows=sample_rows,
            logits_indices=torch.from_numpy(logits_indices).to(dev),
            mm_embeds=mm,
        )

    # ---- 3. forward ------------------------------------------------------------------------
    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, H] of every scheduled token (the last stage's, under pipeline parallelism)."""
        hidden = self._forward_path(inputs)
        self.num_forward_tokens += inputs.num_tokens
        return hidden

    # ---- 4. sample -------------------------------------------------------------------------
    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, grammar=None) -> tuple[list[int], dict[str, Logprobs]]:
        """(sampled id per sampling row, logprobs by request id). Rank 0 samples; with tensor
        parallelism it broadcasts the ids, and the logprobs stay empty on the other ranks."""
        rows = inputs.sample_rows
        if not len(rows):
            return [], {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # a collective under TP: every rank
        out: Optional[SamplerOutput] = None
        sample_states: list = []
        if self.is_sampler:
            plain = self.batch.plain_greedy[inputs.rows[rows]].all()  # the usual batch: nothing to build per row
            procs = self.logits_procs
            if not plain or grammar is not None or procs is not None:
                sample_states = [inputs.states[i] for i in rows]
            if procs is not None:  # --logits-processors: told this step's rows first
                procs.update(sample_states)
            md = greedy_metadata() if plain else build_sampling_metadata(sample_states, self.vocab_size, self.device)
            md.batch_processors = procs
            if grammar is not None:
                self._attach_grammar(md, sample_states, grammar)
            out = self.sampler(logits, md)
            ids = out.sampled
        else:
            ids = torch.empty(len(rows), dtype=torch.long)
        ids = self._share_sampled(ids)  # sampled once on rank 0; every rank appends the same tokens
        sampled = ids.tolist()  # the step's one device->host sync
        if out is None or out.logprob_ids is None:
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

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, Logprobs]:
        """Logprobs of prompt tokens 1..P-1 covered by this step's chunk (position p predicts p+1).
        Every rank computes the logits (a collective under TP); only rank 0 builds the table."""
        out: dict[str, Logprobs] = {}
        qsl = inputs.query_start_loc
        for i, st in enumerate(inputs.states):
            k = st.sampling_params.prompt_logprobs
            if k is None or st.num_output_tokens > 0:
                continue
            a = int(inputs.starts[i])
            b = min(a + int(inputs.num_scheduled[i]), st.num_prompt_tokens - 1)
            if b <= a:
                continue
            logits = self.model.compute_logits(hidden[int(qsl[i]) : int(qsl[i]) + (b - a)])
            if not self.is_sampler:
                continue
            lp = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(st.token_ids[a + 1 : b + 1], dtype=torch.long, device=self.device)
            ids, vals, ranks = compute_logprob_table(lp, targets, k)
            out[st.req_id] = Logprobs(ids.tolist(), vals.tolist(), ranks.tolist(), start=a)
        return out

    # ---- 5. update states ------------------------------------------------------------------
    def _update_states(self, inputs: StepInputs, sampled: list[int]) -> list[list[int]]:
        """Append the sampled ids (pipeline parallel: they come back with a later step),
        advance num_computed_tokens; the sampled ids per batch row."""
        states, rows = inputs.states, inputs.sample_rows
        if len(rows) == len(states) == len(sampled):  # every row sampled (decodes, last prefill chunks): the usual step
            sampled_lists = [[tok] for tok in sampled]
            if self.pp is None:
                for st, tok in zip(states, sampled):
                    st.token_ids.append(tok)
        else:
            sampled_lists = [[] for _ in states]
            for tok, i in zip(sampled, rows.tolist()):
                if self.pp is None:
                    states[i].token_ids.append(tok)
                sampled_lists[i] = [tok]
        if self.pp is None and len(sampled):
            self.batch.append_sampled(inputs.rows[rows], np.fromiter(sampled, dtype=np.int32, count=len(sampled)))
        for st, n in zip(states, inputs.seq_lens.tolist()):
            st.num_computed_tokens = n
        return sampled_lists
