"""The int16-activation products' scratch (kernels/csrc/quant_gemm.h): products of up to
kScratchElems activations (a decode step's) quantize into the calling thread's reused buffers,
larger ones into tensors of their own. Both give the same rows bit for bit, and a product after
others of other shapes sees nothing of theirs."""
from __future__ import annotations

import pytest
import torch

from pagedllm.quantization import packed_qweight, qgemm
from pagedllm.quantization.quantized_weight import QuantizedWeight

SCRATCH_ELEMS = 64 << 10


def weight(kernels, kind: str, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    if kind == "int4":
        q = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    else:
        q = (codes * 16 - 128).to(torch.int8)
    scales = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.002
    zeros = torch.randint(0, 16, (n, k // 32), generator=gen).float()
    return packed_qweight.pack(QuantizedWeight(kind, q, scales, zeros, 32, k), kernels)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_scratch_and_tensors_agree(kernels, kind):
    if not kernels.int16_activations():
        pytest.skip("the int16 path needs an AVX-512 build on a CPU with AVX512-VNNI and AVX512-VBMI")
    k = 256
    pw = weight(kernels, kind, 16 * 5 + 3, k, seed=1)
    x = torch.randn(SCRATCH_ELEMS // k + 44, k, generator=torch.Generator().manual_seed(2))
    big = qgemm.quantized_linear(x, pw)  # more than the scratch holds: tensors
    other = weight(kernels, kind, 40, 576, seed=3)
    for m in (1, 9):  # other shapes through the scratch in between
        qgemm.quantized_linear(torch.randn(m, 576), other)
    for rows in (slice(0, 64), slice(100, 117)):
        assert torch.equal(qgemm.quantized_linear(x[rows].contiguous(), pw), big[rows])
    one = qgemm.quantized_linear(x[:1], pw)
    qgemm.quantized_linear(torch.randn(200, 576), other)
    assert torch.equal(qgemm.quantized_linear(x[:1], pw), one)
