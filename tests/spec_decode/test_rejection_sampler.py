"""The rejection sampler on synthetic target and proposal distributions: emitted tokens follow the
target distribution (chi-square over many draws, fixed seed so it cannot flake), greedy rows are a
prefix match, one-hot (n-gram) proposals, logprobs of the emitted tokens."""
import numpy as np
import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection_sampler import RejectionSampler

V = 6
CHI2_999_DF5 = 20.52  # chi-square 0.999 quantile, 5 degrees of freedom


def metadata(rows, greedy=False, logprobs=None, temperature=None):
    return SamplingMetadata(
        all_greedy=greedy, greedy_rows=None, temperature=temperature, top_k=None, top_p=None, min_p=None,
        generators={}, bias_rows=None, bias_cols=None, bias_vals=None, ban_rows=None, ban_cols=None,
        presence=None, frequency=None, repetition=None, seen_rows=None, seen_cols=None, seen_output_counts=None,
        max_num_logprobs=logprobs)


def chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


def run(p_rows, q_rows, n, k, one_hot=False, seed=0):
    """n identical requests with k drafts each; target rows p_rows [k+1, V] (the same whatever the
    drafts), proposals q_rows [k, V] (drafts drawn from them, or fixed tokens when one_hot)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.log(p_rows[: k + 1]).repeat(n, 1)
    if one_hot:
        drafts = p_rows[:k].argmax(dim=1).repeat(n)  # a lookup proposes fixed tokens
        dprobs = None
    else:
        drafts = torch.multinomial(q_rows[:k], n, replacement=True, generator=g).T.reshape(-1)
        dprobs = q_rows[:k].repeat(n, 1)
    sampler = RejectionSampler(torch.Generator().manual_seed(seed + 1))
    out = sampler(logits, metadata(n * (k + 1)), np.full(n, k), drafts, dprobs)
    return out, drafts.view(n, k)


@pytest.fixture(scope="module")
def dists():
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, dim=-1)
    return p, q


@pytest.mark.parametrize("one_hot", [False, True])
def test_emitted_tokens_follow_the_target(dists, one_hot):
    p, q = dists
    n = 40000
    out, drafts = run(p, q, n, 2, one_hot)
    first = out.tokens[:, 0]
    assert chi2(first, p[0]) < CHI2_999_DF5
    assert chi2(first, q[0]) > 10 * CHI2_999_DF5  # the test can tell distributions apart
    # The second token exists when the first draft was accepted; then it follows p[1].
    second = out.tokens[out.num_accepted >= 1, 1]
    assert len(second) > 2000 and chi2(second, p[1]) < CHI2_999_DF5
    third = out.tokens[out.num_accepted == 2, 2]  # the bonus token after both drafts
    assert len(third) > 500 and chi2(third, p[2]) < CHI2_999_DF5
    # Layout: accepted drafts, then one token, then -1.
    acc = out.num_accepted
    assert torch.equal(out.tokens[acc >= 1, 0], drafts[acc >= 1, 0])
    assert bool((out.tokens[acc == 0, 1:] == -1).all()) and bool((out.tokens[acc == 1, 2] == -1).all())


def test_acceptance_rate_is_sum_of_min_p_q(dists):
    p, q = dists
    n = 40000
    out, _ = run(p, q, n, 1)
    rate = float((out.num_accepted >= 1).double().mean())
    assert abs(rate - float(torch.minimum(p[0], q[0]).sum())) < 0.015


def test_greedy_is_a_prefix_match():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0],  # request 0: 2 drafts
                           [0.0, 1.0, 2.0]])  # request 1: no drafts
    drafts = torch.tensor([1, 2])  # the first matches the argmax (1), the second does not (0)
    out = RejectionSampler(torch.Generator())(logits, metadata(4, greedy=True), np.array([2, 0]), drafts)
    assert out.tokens.tolist() == [[1, 0, -1], [2, -1, -1]]
    assert out.num_accepted.tolist() == [1, 0]


def test_logprobs_of_emitted_tokens(dists):
    p, q = dists
    logits = torch.log(p)  # one request, 2 drafts
    drafts = torch.tensor([int(p[0].argmax()), int(p[1].argmax())])
    out = RejectionSampler(torch.Generator().manual_seed(0))(logits, metadata(3, greedy=True, logprobs=2),
                                                             np.array([2]), drafts)
    assert out.num_accepted.tolist() == [2]
    toks = out.tokens[0].tolist()
    for row in range(3):
        assert out.logprob_ids[row, 0] == toks[row]
        assert torch.allclose(out.logprob_vals[row, 0], torch.log(p[row, toks[row]]), atol=1e-5)
        assert out.logprob_ranks[row] == 1
