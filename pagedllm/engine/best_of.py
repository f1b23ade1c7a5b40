"""best_of > n for sampling: best_of sequences are sampled (as n = best_of children sharing the
prompt's blocks), and only when all are finished the n with the highest mean logprob per
generated token are returned (OpenAI's definition), re-indexed 0..n-1 in that order. The
children always compute their sampled tokens' logprobs for this; a request that did not ask
for logprobs gets none back."""
from __future__ import annotations

from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import SamplingParams


def num_sequences(params: SamplingParams) -> int:
    """Sequences the request runs (what max_n and admission limits count)."""
    return max(params.n, params.best_of or 0)


def uses_best_of(params: SamplingParams) -> bool:
    return params.best_of is not None and params.best_of > params.n


def child_params(params: SamplingParams) -> SamplingParams:
    """Logprobs of the sampled tokens are needed to rank the candidates."""
    return params.clone(logprobs=0) if params.logprobs is None else params


def mean_logprob(c: CompletionOutput) -> float:
    if not c.token_ids:
        return float("-inf")
    return (c.cumulative_logprob or 0.0) / len(c.token_ids)


def pick_best(completions: list[CompletionOutput], params: SamplingParams) -> list[CompletionOutput]:
    best = sorted(completions, key=mean_logprob, reverse=True)[: params.n]  # stable: lower index first on ties
    for i, c in enumerate(best):
        c.index = i
        if params.logprobs is None:
            c.logprobs = None
            c.cumulative_logprob = None
    return best
