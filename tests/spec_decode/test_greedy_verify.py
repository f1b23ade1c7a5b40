"""The verifier's host prefix match for all-greedy batches gives the rejection sampler's grid
(random logits and drafts, requests with 0..k drafts, drafts that match the argmax by parts)."""
import numpy as np
import torch

from pagedllm.sample.rejection_sampler import RejectionSampler
from pagedllm.sample.sampler import greedy
from pagedllm.spec_decode.verifier import _greedy_prefix_match
from test_rejection_sampler import metadata


def test_host_prefix_match_equals_rejection_sampler():
    rng = np.random.default_rng(0)
    for trial in range(50):
        k = rng.integers(0, 6, size=rng.integers(1, 7))
        rows = int((k + 1).sum())
        logits = torch.randn(rows, 11, generator=torch.Generator().manual_seed(trial))
        am = greedy(logits).numpy()
        row_starts = np.concatenate([[0], np.cumsum(k + 1)[:-1]])
        drafts = []
        for i, kk in enumerate(k.tolist()):  # agree with the argmax for a random prefix, then random tokens
            agree = rng.integers(0, kk + 1)
            drafts += [int(am[row_starts[i] + j]) if j < agree else int(rng.integers(0, 11)) for j in range(kk)]
        drafts = np.asarray(drafts, dtype=np.int64)
        ref = RejectionSampler(torch.Generator().manual_seed(1))(logits, metadata(rows, greedy=True), k,
                                                                 torch.from_numpy(drafts))
        assert torch.equal(_greedy_prefix_match(am, k, row_starts, drafts), ref.tokens)
