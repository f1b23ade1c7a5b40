"""ModelRunner: SchedulerOutput -> one flat forward over the ragged batch -> sampled tokens.

One step, in named parts (``execute``):
 1. apply the scheduler's diffs to the persistent request states;
 2. prepare inputs: the batch tensors, built once with numpy (input ids, positions, slot
    mapping, block table, query_start_loc, seq_lens, logits indices) and AttentionMetadata;
 3. forward: ONE pass over the ragged batch;
 4. sample: logits only for the rows that sample; the sampled ids reach the host with the
    step's one device->host sync;
 5. update states: append the sampled ids and advance num_computed_tokens.

Each feature's part of the step is a plug-in chosen once at construction, so the step calls it
unconditionally: the worker's (worker/runner_plugins.py: LoRA, speculative decoding, CUDA
graphs, the KV offload tier, logits processors) and what the runner builds from this rank's place:
- the pipeline stage role (worker/pipeline_stage.py): the forward path; whether the step ends at
  this stage or emits tokens; how the sampled ids are shared (the TP broadcast) and kept
  (appended here, or, under pipeline parallelism, sent to every stage with a later step's diffs);
- its part in sampling (worker/sampling_rank.py): one rank samples (tp rank 0 of the last stage),
  applies the grammar masks, holds the seeded generators and builds the logprobs; every other
  rank takes part in the logits' collectives and gets the ids from the broadcast;
- the beam rows (worker/beam_rows.py): copy-on-write block copies, beams scored, not sampled.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.core.contracts import Logprobs, ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group
from pagedllm.sample.metadata import is_plain_greedy
from pagedllm.worker.beam_rows import BeamRows
from pagedllm.worker.encoder_cache import encoder_cache_for
from pagedllm.worker.input_batch import CachedRequestState, InputBatch, StepInputs
from pagedllm.worker.pipeline_stage import pipeline_stage
from pagedllm.worker.runner_plugins import NoKVTier, RunnerPlugins, whole_model_forward
from pagedllm.worker.sampling_rank import sampling_rank


class ModelRunner:
    def __init__(self, model, block_size: int, vocab_size: int, device: torch.device, seed: int,
                 plugins: RunnerPlugins = RunnerPlugins()) -> None:
        self.model = model
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        # fixed at construction: another engine in the process may have other groups
        tp = get_tp_group()
        self.stage = pipeline_stage(get_pp_group(), tp, model, device, whole_model_forward(model, plugins))
        self.sampling = sampling_rank(tp, self.stage, seed, device, vocab_size, plugins.logits)
        self.requests: dict[str, CachedRequestState] = {}
        self.batch = InputBatch()  # every held request's row: block ids, sampling facts (kept across steps)
        self.block_table = self.batch.block_table
        self.beams = BeamRows(model)
        # held requests that want prompt logprobs: a step without any skips their per-row pass
        self._num_prompt_logprob_rows = 0
        self.num_forward_tokens = 0
        self.lora = plugins.lora
        self.kv_tier = plugins.kv_tier if plugins.kv_tier is not None else NoKVTier()
        self.spec = plugins.spec(self.sampling.generator)
        # a multimodal model: its requests' images and the encoder outputs their prefill still needs
        self.encoder_cache = encoder_cache_for(model, device)

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """prepare -> forward -> (on a stage that samples) sample / verify / score -> update."""
        tier = self._run_kv_transfers(so)  # the KV offload tier first: stores read blocks this step reuses
        self._apply_diffs(so)
        if so.is_empty:
            return ModelRunnerOutput([], [], **tier)
        inputs = self._prepare_inputs(so, *self.spec.propose(self, so))
        hidden = self._forward(inputs)
        return self.stage.finish(self, so, inputs, hidden, tier)

    def execute_host(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """The host's part of ``execute`` alone, for a simulated device (executor/simulated.py):
        diffs, input preparation and the state update and output as a step builds them, with
        the forward and the sampling replaced by ids made from the positions (plain requests,
        no drafts)."""
        tier = self._run_kv_transfers(so)
        self._apply_diffs(so)
        if so.is_empty:
            return ModelRunnerOutput([], [], **tier)
        inputs = self._prepare_inputs(so)
        self.num_forward_tokens += inputs.num_tokens
        sampled = ((inputs.seq_lens[inputs.sample_rows] * 7 + 3) % self.vocab_size).tolist()
        return ModelRunnerOutput(inputs.req_ids, self._update_states(inputs, sampled), **tier)

    def emit_tokens(self, so: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
                    tier: dict) -> ModelRunnerOutput:
        """The step's tokens, on a stage that samples. ``so.grammar``: the step's structured-output
        masks (on the sampling rank)."""
        # before the states grow
        prompt_logprobs = self._prompt_logprobs(inputs, hidden) if self._num_prompt_logprob_rows else {}
        beams = self.beams.score(inputs, hidden, self.sampling)  # takes the beam rows out of sampling
        sampled_lists, logprobs, num_drafts = self.spec.sample_or_verify(self, so, inputs, hidden)
        self.spec.observe(self, inputs, hidden)  # EAGLE: the target's hidden states of the computed positions
        return ModelRunnerOutput(inputs.req_ids, sampled_lists, logprobs, prompt_logprobs,
                                 num_draft_tokens=num_drafts, beam_candidates=beams, **tier)

    def _run_kv_transfers(self, so: SchedulerOutput) -> dict:
        """The step's KV offload tier moves; the output fields reporting them (none without)."""
        if not so.kv_transfers:
            return {}
        failed, seconds = self.kv_tier.run(so.kv_transfers)
        return {"failed_kv_loads": failed, "kv_transfer_seconds": seconds}

    # ---- 1. state diffs ---------------------------------------------------------------------
    def _apply_diffs(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self._drop(rid)
            self.sampling.forget(rid)
        for rid in so.preempted_req_ids:
            self._drop(rid)
        for slot, handle in so.lora_loads:  # adapters the scheduler put into slots for this step
            self.lora.load(slot, handle)
        self.beams.copy_blocks(so.block_copies)
        for nr in so.scheduled_new_reqs:
            gen = self.sampling.generator_for(nr.req_id, nr.sampling_params.seed)
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
            self.encoder_cache.add(nr.req_id, nr.mm_features)
            self.beams.add(nr.beam)
            self._num_prompt_logprob_rows += nr.sampling_params.prompt_logprobs is not None
        table = self.block_table
        one_rows, one_ids = [], []  # rows taking exactly one new block: appended in one scatter below
        for cr in so.scheduled_cached_reqs:
            st = self.requests[cr.req_id]
            if cr.new_token_ids:  # pipeline parallelism: ids sampled by earlier steps
                st.token_ids.extend(cr.new_token_ids)
                self.batch.append_tokens(st.row, cr.new_token_ids)
            new_ids = cr.new_block_ids
            if new_ids or cr.num_dropped_block_ids:  # dropped: blocks of rejected drafts went back
                if len(new_ids) == 1 and not cr.num_dropped_block_ids:
                    one_rows.append(st.row)
                    one_ids.append(new_ids[0])
                else:
                    table.append(st.row, new_ids, cr.num_dropped_block_ids)
            st.num_computed_tokens = cr.num_computed_tokens
        if one_rows:
            table.append_one(np.array(one_rows, dtype=np.int64), np.array(one_ids, dtype=np.int32))

    def _drop(self, req_id: str) -> None:
        st = self.requests.pop(req_id, None)
        if st is not None:
            self.batch.remove(st.row)
            self.beams.remove(st.beam)
            self._num_prompt_logprob_rows -= st.sampling_params.prompt_logprobs is not None
        self.encoder_cache.drop(req_id)

    # ---- 2. prepare inputs ------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput, drafts: Optional[dict[str, list[int]]] = None,
                        draft_probs: Optional[torch.Tensor] = None) -> StepInputs:
        """``drafts``: speculative tokens per request, placed by the spec plug-in after its last
        token (their reserved slots beyond the drafts stay unused); ``draft_probs``: theirs."""
        req_ids = list(so.num_scheduled_tokens)
        requests, batch = self.requests, self.batch
        states = [requests[r] for r in req_ids]
        n_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        self.spec.place_drafts(so, drafts, states, n_sched, batch)
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        seq_lens = starts + n_sched
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(n_sched, out=qsl[1:])
        total = int(qsl[-1])

        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
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
        mm = self.encoder_cache.step_embeds(req_ids, starts, n_sched, qsl)
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
            drafts=drafts,
            draft_probs=draft_probs,
        )

    # ---- 3. forward ------------------------------------------------------------------------
    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, H] of every scheduled token (the last stage's, under pipeline parallelism)."""
        hidden = self.stage.forward(inputs)
        self.num_forward_tokens += inputs.num_tokens
        return hidden

    # ---- 4. sample -------------------------------------------------------------------------
    def sample_tokens(self, inputs: StepInputs, hidden: torch.Tensor, grammar=None
                      ) -> tuple[list[list[int]], dict[str, Logprobs]]:
        """(the sampled ids per batch row, logprobs by request id); the states grow by them."""
        sampled, logprobs = self._sample(inputs, hidden, grammar)
        return self._update_states(inputs, sampled), logprobs

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, grammar=None) -> tuple[list[int], dict[str, Logprobs]]:
        """(sampled id per sampling row, logprobs by request id). The sampling rank samples; with
        tensor parallelism it broadcasts the ids, and the logprobs stay empty on the other ranks."""
        if not len(inputs.sample_rows):
            return [], {}
        idx = inputs.logits_indices  # increasing, so as many as the hidden rows is every row: no gather
        rows = hidden if len(idx) == hidden.shape[0] else hidden[idx]
        logits = self.model.compute_logits(rows)  # a collective under TP: every rank
        return self.sampling.sample(logits, inputs, self.batch.plain_greedy, grammar, self.stage.share_sampled)

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, Logprobs]:
        """Logprobs of prompt tokens 1..P-1 covered by this step's chunk (position p predicts p+1).
        Every rank computes the logits (a collective under TP); only the sampling rank builds the table."""
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
            table = self.sampling.prompt_logprobs(logits, st.token_ids, a, b, k)
            if table is not None:
                out[st.req_id] = table
        return out

    # ---- 5. update states ------------------------------------------------------------------
    def _update_states(self, inputs: StepInputs, sampled: list[int]) -> list[list[int]]:
        """Keep the sampled ids as the stage keeps them (appended here; pipeline parallel: they come
        back with a later step), advance num_computed_tokens; the sampled ids per batch row."""
        states, rows = inputs.states, inputs.sample_rows
        if len(rows) == len(states) == len(sampled):  # every row sampled (decodes, last prefill chunks): the usual step
            sampled_lists = [[tok] for tok in sampled]
        else:
            sampled_lists = [[] for _ in states]
            for tok, i in zip(sampled, rows.tolist()):
                sampled_lists[i] = [tok]
        self.stage.keep_sampled(self.batch, inputs, sampled)
        for st, n in zip(states, inputs.seq_lens.tolist()):
            st.num_computed_tokens = n
        return sampled_lists
