"""The structured-output bitmask applied to logits: xgrammar's kernel and the torch fallback agree
with a per-bit reference, for all rows, a subset of rows, and widths that are not multiples of 32."""
import pytest
import torch

from pagedllm.sample.logits_mask import apply_token_bitmask, torch_apply_token_bitmask, unpack_bitmask


def _reference(logits, rows, bitmask):
    out = logits.clone()
    for i, r in enumerate(rows.tolist()):
        for tok in range(logits.shape[1]):
            word, bit = divmod(tok, 32)
            if word >= bitmask.shape[1] or not (int(bitmask[i, word]) >> bit) & 1:
                out[r, tok] = float("-inf")
    return out


@pytest.mark.parametrize("width", [64, 70, 100])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_bitmask_matches_reference(width, rows):
    g = torch.Generator().manual_seed(width + len(rows))
    logits = torch.randn(4, width, generator=g)
    rows_t = torch.tensor(rows)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (width + 31) // 32), dtype=torch.int32, generator=g)
    want = _reference(logits, rows_t, bitmask)
    assert torch.equal(apply_token_bitmask(logits.clone(), rows_t, bitmask), want)
    assert torch.equal(torch_apply_token_bitmask(logits.clone(), rows_t, bitmask), want)


def test_logits_wider_than_bitmask_disallow_the_rest():
    bitmask = torch.full((1, 1), -1, dtype=torch.int32)  # 32 ids allowed
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed[0, :32].all() and not allowed[0, 32:].any()
    out = apply_token_bitmask(torch.zeros(1, 40), torch.tensor([0]), bitmask)
    assert torch.isinf(out[0, 32:]).all() and (out[0, :32] == 0).all()


@pytest.mark.parametrize("width", [31, 64, 100, 1000])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [3, 1], [2]])
def test_cpu_kernel_matches_reference(kernels, width, rows):
    """The C++ kernel (AVX-512 masked stores where the CPU has them, scalar words otherwise) on
    random words, all-ones and all-zero words, and a bitmask narrower than the logits."""
    g = torch.Generator().manual_seed(width * 7 + len(rows))
    logits = torch.randn(4, width, generator=g)
    rows_t = torch.tensor(rows)
    words = (width + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=g)
    bitmask[:, ::3] = -1  # all allowed
    bitmask[:, 1::5] = 0  # all forbidden
    for bm in (bitmask, bitmask[:, : max(1, words - 1)].contiguous()):
        want = _reference(logits, rows_t, bm)
        got = logits.clone()
        kernels.apply_token_bitmask(got, rows_t, bm)
        assert torch.equal(got, want)
        assert torch.equal(apply_token_bitmask(logits.clone(), rows_t, bm), want)  # the dispatch picks it
