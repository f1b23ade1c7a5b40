"""Categorical sampling from one uniform per row: the fused C++ kernel (sample_rows) and the
torch inverse-CDF path agree, match softmax(logits / T) in distribution, never pick a -inf
(banned) token, and take the argmax at temperature 0. Seeds are fixed: nothing here is random."""
from __future__ import annotations

import pytest
import torch

from pagedllm.sample.sampler import inverse_cdf


@pytest.fixture(scope="module")
def sample_rows(kernels):
    if not hasattr(kernels, "sample_rows"):
        pytest.skip("the C++ kernels have no sample_rows")
    return kernels.sample_rows


def test_kernel_and_torch_path_agree_and_match_softmax(sample_rows):
    g = torch.Generator().manual_seed(0)
    V, N = 200, 50_000
    logits = torch.randn(V, generator=g) * 2
    logits[::7] = float("-inf")  # banned tokens
    rows = logits.repeat(N, 1)
    temp = torch.full((N,), 0.7)
    u = torch.rand(N, generator=g)
    out = torch.empty(N, dtype=torch.long)
    sample_rows(out, rows, temp, u)
    ref = inverse_cdf(torch.softmax(rows / 0.7, dim=-1), u)
    assert (out == ref).float().mean() > 0.999  # differ only where u falls within rounding of a boundary
    assert not torch.isinf(logits[out]).any()
    p = torch.softmax(logits / 0.7, dim=-1)
    freq = torch.bincount(out, minlength=V).double() / N
    assert (freq - p).abs().max() < 1e-2  # a few standard errors (sqrt(p / N) <= 1.5e-3)


def test_temperature_zero_is_argmax_and_a_single_token_is_always_chosen(sample_rows):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 50, generator=g)
    logits[3] = float("-inf")
    logits[3, 17] = 0.0
    temp = torch.tensor([0.0, 1.0, 0.0, 1.0, 2.0, 0.0, 0.5, 1.0])
    out = torch.empty(8, dtype=torch.long)
    for _ in range(20):
        sample_rows(out, logits, temp, torch.rand(8, generator=g))
        zero = temp == 0
        assert torch.equal(out[zero], logits[zero].argmax(-1))
        assert out[3] == 17


def test_odd_vocab_sizes_and_uniform_extremes(sample_rows):
    for V in (1, 7, 16, 33):
        logits = torch.zeros(2, V)
        out = torch.empty(2, dtype=torch.long)
        sample_rows(out, logits, torch.ones(2), torch.tensor([0.0, 0.9999999]))
        assert out.tolist() == [0, V - 1]


def test_top_k_path_picks_what_the_full_sort_path_picks():
    """With every row under a top-k the sampler filters among the k largest (no full sort); one
    uniform must pick the same token as through the full-vocabulary path, so a seeded request's
    tokens do not depend on the other rows of its batch."""
    from pagedllm.sample.sampler import Sampler

    g = torch.Generator().manual_seed(3)
    B, V = 64, 500
    probs = torch.softmax(torch.randn(B, V, generator=g) * 2, dim=-1)
    top_k = torch.randint(1, 40, (B,), generator=g)
    top_p = torch.rand(B, generator=g) * 0.5 + 0.5
    u = torch.rand(B, generator=g)
    full = inverse_cdf(Sampler._top_k_top_p(probs, top_k, top_p), u)
    vals, ids = probs.topk(int(top_k.max()), dim=-1)
    kept = Sampler._top_k_top_p_sorted(vals, top_k, top_p)
    ids, order = ids.sort(dim=-1)
    fast = ids.gather(1, inverse_cdf(kept.gather(1, order), u).unsqueeze(1)).squeeze(1)
    assert torch.equal(fast, full)
