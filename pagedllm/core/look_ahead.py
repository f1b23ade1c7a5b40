"""Look-ahead policies: how many KV slots a decoding request reserves beyond its next token.

Speculative decoding is the one look-ahead today: a decoding request reserves up to
``num_spec_tokens`` draft slots after its next token (``SchedulerOutput.num_spec_slots``); the
runner proposes at most that many drafts and verifies them in the same forward; after the step
``settle`` keeps the accepted drafts' slots and gives back the blocks that held only rejected
ones (the workers drop them with the request's next diff). Without speculation the policy is
``NoLookAhead``: nothing reserved, nothing to settle.
"""
from __future__ import annotations

from typing import Optional, Protocol

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request


class LookAheadPolicy(Protocol):
    governor: Optional[object]  # speculative decoding's SpecGovernor (None: always speculate)
    counts: list[int]  # rows verified with drafts, drafts, accepted drafts
    drafts: bool  # False: slots() is always 0 and nothing is ever dropped (callers may skip both)

    def start_step(self, num_running: int) -> None: ...

    def slots(self, req: Request, num_new: int, budget: int, num_running: int) -> int: ...

    def end_step(self, num_reqs: int, num_speculating: int, total: int) -> None: ...

    def settle(self, req: Request, reserved: int, num_drafts: int, num_sampled: int) -> None: ...

    def end_output(self) -> None: ...

    def take_dropped_blocks(self, req_id: str) -> int: ...

    def forget(self, req_id: str) -> None: ...

    def stats(self) -> dict: ...


class NoLookAhead:
    governor = None
    drafts = False

    def __init__(self) -> None:
        self.counts = [0, 0, 0]

    def start_step(self, num_running: int) -> None:
        pass

    def slots(self, req: Request, num_new: int, budget: int, num_running: int) -> int:
        return 0

    def end_step(self, num_reqs: int, num_speculating: int, total: int) -> None:
        pass

    def settle(self, req: Request, reserved: int, num_drafts: int, num_sampled: int) -> None:
        pass

    def end_output(self) -> None:
        pass

    def take_dropped_blocks(self, req_id: str) -> int:
        return 0

    def forget(self, req_id: str) -> None:
        pass

    def stats(self) -> dict:
        return {}


class SpecLookAhead:
    """Draft slots for speculative decoding. ``governor`` (spec_decode/governor.py's SpecGovernor,
    or None) says per step whether decoding requests get draft slots at all; a plain step reserves
    nothing. Seeded requests speculate regardless: how many uniforms their stream gives up per step
    must not depend on the governor's timing."""

    drafts = True

    def __init__(self, num_spec_tokens: int, disable_batch_size: int, max_model_len: int, kv: KVCacheManager,
                 governor=None) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.disable_batch_size = disable_batch_size
        self.max_model_len = max_model_len
        self.kv = kv
        self.governor = governor
        self._speculate = True
        self._num_plain = 0  # decoding requests the governor kept plain this step
        self._dropped: dict[str, int] = {}  # tail block ids the workers must drop, per request
        self._verified = [0, 0, 0]  # this step's rows with drafts, their tokens, drafts (for the governor)
        self.counts = [0, 0, 0]  # rows with drafts, drafts, accepted drafts
        self.accepted_per_pos = [0] * num_spec_tokens

    def start_step(self, num_running: int) -> None:
        self._speculate = self.governor.plan(num_running) if self.governor is not None else True
        self._num_plain = 0

    def slots(self, req: Request, num_new: int, budget: int, num_running: int) -> int:
        """Draft slots after a decoding request's next token, so that the accepted drafts plus one
        token never pass max_tokens or max_model_len. Requests with a grammar decode one token per
        step (the mask covers one position)."""
        if num_new != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        if self.disable_batch_size and num_running >= self.disable_batch_size:
            return 0
        if req.sampling_params.structured_outputs is not None:
            return 0
        n = max(0, min(self.num_spec_tokens, budget - 1, req.max_tokens - req.num_output_tokens - 1,
                       self.max_model_len - req.num_tokens - 1))
        if n and not self._speculate and req.sampling_params.seed is None:
            self._num_plain += 1
            return 0
        return n

    def end_step(self, num_reqs: int, num_speculating: int, total: int) -> None:
        if self.governor is None:
            return
        # measurable: only decodes, all speculating or none
        only_decodes = total and num_reqs == num_speculating + self._num_plain
        mixed = num_speculating and self._num_plain
        self.governor.scheduled(None if not only_decodes or mixed else bool(num_speculating))

    def settle(self, req: Request, reserved: int, num_drafts: int, num_sampled: int) -> None:
        """After a verification step: the computed count covers the accepted drafts only (the
        last sampled token is computed next step), blocks holding only rejected drafts are freed,
        and the acceptance counters advance."""
        req.num_computed_tokens -= 1 + reserved - num_sampled
        dropped = self.kv.rollback(req)
        if dropped:
            self._dropped[req.request_id] = self._dropped.get(req.request_id, 0) + dropped
        v = self._verified
        v[0], v[1], v[2] = v[0] + 1, v[1] + num_sampled, v[2] + num_drafts
        if num_drafts:
            accepted = num_sampled - 1
            self.counts[0] += 1
            self.counts[1] += num_drafts
            self.counts[2] += accepted
            for j in range(accepted):  # at most num_speculative_tokens per request
                self.accepted_per_pos[j] += 1

    def end_output(self) -> None:
        rows, tokens, drafts = self._verified
        self._verified = [0, 0, 0]
        if self.governor is not None:
            self.governor.verified(tokens / rows if rows else 1.0, drafts)

    def take_dropped_blocks(self, req_id: str) -> int:
        return self._dropped.pop(req_id, 0)

    def forget(self, req_id: str) -> None:
        self._dropped.pop(req_id, None)

    def stats(self) -> dict:
        return {"spec_num_drafts": self.counts[0], "spec_num_draft_tokens": self.counts[1],
                "spec_num_accepted_tokens": self.counts[2], "spec_accepted_per_pos": tuple(self.accepted_per_pos)}


def make_look_ahead(num_spec_tokens: int, disable_batch_size: int, max_model_len: int, kv: KVCacheManager,
                    governor: Optional[object] = None) -> LookAheadPolicy:
    if not num_spec_tokens:
        return NoLookAhead()
    return SpecLookAhead(num_spec_tokens, disable_batch_size, max_model_len, kv, governor)
