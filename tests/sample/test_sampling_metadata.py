"""build_sampling_metadata: unused parameters stay None, rows keep their order, seeded rows get
their generator, the prompt mask is cached on the state."""
from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedllm.sample.metadata import build_sampling_metadata
from pagedllm.sampling_params import SamplingParams

V = 32


@dataclass
class Row:  # the fields SamplingRowState names, nothing from worker/
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: Optional[torch.Generator] = None
    prompt_unique_ids: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def build(rows):
    return build_sampling_metadata(rows, V, torch.device("cpu"))


def test_all_greedy_builds_no_tensor():
    md = build([Row([1, 2, 3], 3, SamplingParams(temperature=0)), Row([4, 5], 2, SamplingParams(temperature=0))])
    assert md.all_greedy and md.max_num_logprobs is None and md.generators == {}
    assert all(getattr(md, f) is None for f in ("greedy_rows", "temperature", "top_k", "top_p", "min_p", "bias_rows",
                                                "ban_rows", "presence", "frequency", "repetition", "seen_rows"))


def test_mixed_rows_in_order():
    gen = torch.Generator()
    rows = [
        Row([1, 2], 2, SamplingParams(temperature=0, logprobs=2)),
        Row([3, 4, 7], 2, SamplingParams(temperature=0.5, top_k=100, top_p=0.9, seed=1, logprobs=4), generator=gen),
        Row([5], 1, SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[9], logit_bias={6: 2.0, 99: 1.0})),
    ]
    md = build(rows)
    assert not md.all_greedy
    assert md.greedy_rows.tolist() == [True, False, False]
    assert md.temperature.tolist() == [1.0, 0.5, 1.0]
    # top_k above the vocabulary is the whole vocabulary; a greedy row's is 1 (it takes the argmax
    # anyway, and must not force the sampler into a full-vocabulary sort)
    assert md.top_k.tolist() == [1, V, V] and md.top_k_max == V
    assert md.top_p.tolist() == [1.0, 0.8999999761581421, 1.0]
    assert md.generators == {1: gen}
    assert list(zip(md.bias_rows.tolist(), md.bias_cols.tolist(), md.bias_vals.tolist())) == [(2, 6, 2.0)]
    assert (2, 9) in list(zip(md.ban_rows.tolist(), md.ban_cols.tolist()))
    assert md.max_num_logprobs == 4


def test_penalties_count_outputs_and_cache_prompt_tokens():
    row = Row([3, 4, 5, 5, 7, 7], 3, SamplingParams(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.2))
    plain = Row([1], 1, SamplingParams(temperature=1.0))
    md = build([row, plain])
    seen = {(r, c): n for r, c, n in zip(md.seen_rows.tolist(), md.seen_cols.tolist(), md.seen_output_counts.tolist())}
    # row 0 saw 3, 4, 5 in its prompt and 5, 7, 7 in its output; the plain row has no entries
    assert seen == {(0, 3): 0.0, (0, 4): 0.0, (0, 5): 1.0, (0, 7): 2.0}
    assert md.presence is None and md.frequency.tolist() == [0.5, 0.0]
    assert row.prompt_unique_ids.tolist() == [3, 4, 5] and plain.prompt_unique_ids is None


def test_sparse_penalties_equal_the_dense_definition():
    """The sampler's penalties on the seen pairs only equal the dense definition over [B, V]."""
    from pagedllm.sample.sampler import Sampler

    g = torch.Generator().manual_seed(0)
    rows = [Row([5, 9, 9, 2, 5, 5, 11], 4, SamplingParams(temperature=1.0, repetition_penalty=1.3,
                                                          frequency_penalty=0.4, presence_penalty=0.7)),
            Row([1, 2], 2, SamplingParams(temperature=1.0)),
            Row([7, 8, 8], 1, SamplingParams(temperature=1.0, repetition_penalty=0.8))]
    md = build(rows)
    logits = torch.randn(3, V, generator=g)
    got = Sampler._apply_constraints(logits.clone(), md)
    want = logits.clone()
    for i, r in enumerate(rows):
        sp, prompt, out = r.sampling_params, r.token_ids[: r.num_prompt_tokens], r.token_ids[r.num_prompt_tokens:]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V).float() if out else torch.zeros(V)
        seen = counts > 0
        seen[torch.tensor(prompt)] = True
        rep = sp.repetition_penalty
        want[i] = torch.where(seen, torch.where(want[i] > 0, want[i] / rep, want[i] * rep), want[i])
        want[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
    torch.testing.assert_close(got, want)
