"""The C++ GGUF block-format kernels (kernels/csrc/gguf_gemm.h) for every ISA level this CPU runs,
against gguf-py's reference dequantization (gguf.quants.dequantize, the format's definition):
rows dequantized equal the reference to float32 rounding (fused multiply-adds may differ by an
ulp), and gguf_linear equals x @ dequantize(W)^T to float32 summation error, on the GEMV path
(M <= 4: register-dequantized blocks for the 32-element formats, an L1 row buffer for the others)
and the tile path (larger M), float32 and bf16 activations, an output with a row stride (one
segment of a fused layer). Blocks are random bytes with sane f16 scales, so every code value and
every high-bit pattern occurs."""
from __future__ import annotations

import pytest
import torch

from kernel_levels import kernels_at_level

gguf = pytest.importorskip("gguf")
from gguf_files import random_blocks as random_packed, reference_dequantize as reference  # noqa: E402

LEVELS = ["scalar", "avx2", "avx512"]
TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module", params=LEVELS)
def level_kernels(request):
    return kernels_at_level(request.param)


def test_types_listed(level_kernels):
    assert sorted(level_kernels.gguf_types()) == sorted(int(gguf.GGMLQuantizationType[t]) for t in TYPES)


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_rows(level_kernels, type_name):
    packed = random_packed(type_name, 37, 512, seed=1)
    ref = reference(packed, type_name)
    rows = torch.tensor([0, 36, 5, 5, 17], dtype=torch.int64)
    got = level_kernels.gguf_dequantize(torch.from_numpy(packed), int(gguf.GGMLQuantizationType[type_name]), rows,
                                        512)
    torch.testing.assert_close(got, ref[rows], rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_linear(level_kernels, type_name, m):
    n, k = 45, 768
    packed = random_packed(type_name, n, k, seed=m)
    w = reference(packed, type_name).double()
    qtype = int(gguf.GGMLQuantizationType[type_name])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ w.t()
    bound = (x.double().abs() @ w.abs().t()) * 2e-6 + 1e-6
    y = torch.full((m, n), float("nan"))
    level_kernels.gguf_linear(y, x, torch.from_numpy(packed), qtype)
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().max()
    # bf16 activations and output, written into columns [8, 8 + n) of a wider row (a fused layer's segment)
    xb = x.bfloat16()
    wide = torch.zeros(m, n + 16, dtype=torch.bfloat16)
    level_kernels.gguf_linear(wide[:, 8:8 + n], xb, torch.from_numpy(packed), qtype)
    refb = xb.double() @ w.t()
    assert ((wide[:, 8:8 + n].double() - refb).abs() <= bound + refb.abs() * 2.0**-8).all()
    assert (wide[:, :8] == 0).all() and (wide[:, 8 + n:] == 0).all()


def test_refusals(level_kernels):
    packed = torch.from_numpy(random_packed("Q4_0", 4, 64, seed=0))
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="unsupported block type"):
        level_kernels.gguf_linear(torch.empty(1, 4), x, packed, 9)  # Q8_1: not a storage type
    with pytest.raises(RuntimeError, match="bytes"):
        level_kernels.gguf_linear(torch.empty(1, 4), torch.randn(1, 96), packed[:, :30].contiguous(), 2)
    with pytest.raises(RuntimeError, match="out of range"):
        level_kernels.gguf_dequantize(packed, 2, torch.tensor([4]), 64)
