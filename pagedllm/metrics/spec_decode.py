"""Speculative decoding metrics, with vLLM's ``spec_decode`` counters' names and meanings.

``num_drafts``: verification rows that had drafts (one per drafted request per step);
``num_draft_tokens``: drafts proposed; ``num_accepted_tokens``: drafts accepted;
``num_accepted_tokens_per_pos{position}``: acceptances at draft position i (0-based), so
accepted[i] / num_drafts is the chance the first i + 1 drafts all survive; ``num_emitted_tokens``:
tokens those rows produced (accepted drafts plus one drawn token each). The acceptance rate is
accepted / proposed and the mean accepted length 1 + accepted / num_drafts (tokens per
verification step of a drafted request).
"""
from __future__ import annotations

from pagedllm.metrics import counter_delta


class SpecDecodeMetrics:
    def __init__(self, registry, prefix: str, labels: tuple[str, ...], values: tuple[str, ...]) -> None:
        from prometheus_client import Counter, Gauge

        lbl = list(labels)

        def counter(name, doc):
            return Counter(f"{prefix}:spec_decode_{name}", doc, lbl, registry=registry).labels(*values)

        self.num_drafts = counter("num_drafts", "Verification rows with drafts (drafted requests per step).")
        self.num_draft_tokens = counter("num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("num_accepted_tokens", "Draft tokens accepted.")
        # ours, not vLLM's: emitted tokens and the acceptance rate
        self.num_emitted_tokens = counter("num_emitted_tokens",
                                          "Tokens emitted by drafted requests' verification steps.")
        self.per_pos = Counter(f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted, by draft position (0-based).", lbl + ["position"],
                               registry=registry)
        self.acceptance = Gauge(f"{prefix}:spec_decode_draft_acceptance_rate",
                                "Accepted / proposed draft tokens since start.", lbl, registry=registry).labels(*values)
        self._values = values

    def update(self, stats, last) -> None:
        """Advance the counters by the difference between two SchedulerStats snapshots."""
        def delta(name):
            return counter_delta(stats, last, name)

        drafts, accepted = delta("spec_num_drafts"), delta("spec_num_accepted_tokens")
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(delta("spec_num_draft_tokens"))
        self.num_accepted_tokens.inc(accepted)
        self.num_emitted_tokens.inc(accepted + drafts)
        prev = last.spec_accepted_per_pos if last is not None else ()
        for i, n in enumerate(stats.spec_accepted_per_pos):
            d = n - (prev[i] if i < len(prev) else 0)
            if d > 0 or last is None:
                self.per_pos.labels(*self._values, str(i)).inc(max(d, 0))
        if stats.spec_num_draft_tokens:
            self.acceptance.set(stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens)


def spec_decode_summary(stats) -> str:
    """The log line's part: acceptance rate, mean accepted length, per-position acceptance."""
    if not stats.spec_num_drafts:
        return ""
    rate = stats.spec_num_accepted_tokens / max(1, stats.spec_num_draft_tokens)
    mean_len = 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
    per_pos = ", ".join(f"{n / stats.spec_num_drafts:.2f}" for n in stats.spec_accepted_per_pos)
    return (f"spec decode: acceptance {rate:.1%}, mean accepted length {mean_len:.2f}, per position [{per_pos}], "
            f"drafts {stats.spec_num_draft_tokens}, accepted {stats.spec_num_accepted_tokens}")
