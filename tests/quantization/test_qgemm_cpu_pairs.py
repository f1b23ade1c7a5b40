"""The bf16-pair paths of the weight-only quantized matmuls (kernels/csrc/quant_gemm.h) with this
CPU's best kernels, against the float64 product of ``QuantizedWeight.dequantize()``.

With AVX512-BF16 and bf16 x, batches (more than 4 rows) widen each chunk of codes into exact bf16
pairs for vdpbf16ps (int8 / fp8: two float32 widenings interleaved by vpermt2w; int4: a vpermw
table lookup, 4 lines at a time with vpermi2b where the CPU has AVX512-VBMI), and a single bf16
row of int4 (decode) multiplies such pairs directly. These cases reach every branch of that
code: groups of 1, 3 and 5 k pairs (the 4-line loops' tails and a group smaller than a 4-line
block), per-channel groups cut into 256-k chunks with a short last chunk, asymmetric zero points,
act-order, N not a multiple of the 16-row panel or of the 3-panel tasks, M = 1 (decode), 2..4
(the direct microkernel), and 5, 16, 17 (blocked: one and more 8-row tiles, a row tail). On
other builds (avx512 without BF16, avx2, scalar) the same cases check the float32 paths.
Tolerance: 1e-5 of sum |x||w| (float32 sums of exact products), plus one bf16 rounding of the
result for bf16 outputs; float32 x on the int16 path (quant_gemm_i16.h) against x as it rounds it."""
from __future__ import annotations

import pytest
import torch

from pagedllm.quantization import packed_qweight, qgemm
from qgemm_cases import kernel_input, random_input, random_qweight, reference


def assert_close(y, x, qw, bias, kernels):
    ref = reference(kernel_input(x, qw, kernels), qw, bias)
    bound = (x.double().abs() @ qw.dequantize().double().abs().t()) * 1e-5 + 1e-6
    if y.dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("k,group", [(120, 2), (120, 6), (120, 10), (520, -1), (512, 128)])
@pytest.mark.parametrize("asym", [False, True])
def test_pair_paths_match_the_dequantized_product(kernels, kind, k, group, asym):
    n = 50
    qw = random_qweight(kind, n, k, group, asym, perm=group == 10, seed=k + group)
    pw = packed_qweight.pack(qw, kernels)
    for m in (1, 2, 5, 16, 17):
        bias = torch.randn(n) if m % 2 else None
        for dtype in (torch.bfloat16, torch.float32):
            x = random_input(m, k, dtype, seed=m + k)
            y = qgemm.quantized_linear(x, pw, bias)
            assert y.dtype == dtype and y.shape == (m, n)
            assert_close(y, x, qw, bias, kernels)


def test_decode_row_matches_the_same_row_in_a_batch(kernels):
    # batch-1 int4 (pairs multiplied directly) and the blocked batch path agree within float32
    # summation order on a decode-sized layer shape
    qw = random_qweight("int4", 200, 1024, 128, asym=False, seed=7)
    pw = packed_qweight.pack(qw, kernels)
    x = random_input(16, 1024, torch.bfloat16, seed=3)
    batch = qgemm.quantized_linear(x, pw).float()
    for i in (0, 7, 15):
        row = qgemm.quantized_linear(x[i:i + 1], pw).float()
        torch.testing.assert_close(row[0], batch[i], rtol=2.0**-7, atol=1e-3)
    assert_close(qgemm.quantized_linear(x[:1], pw), x[:1], qw, None, kernels)


@pytest.mark.parametrize("kind,group,asym", [("int4", 128, False), ("int4", 20, True), ("int4", 24, False),
                                             ("int8", -1, False), ("fp8", 40, True)])
def test_decode_panel_ranges_on_two_threads(kernels, kind, group, asym):
    # one row of x (decode) on two threads: int4 runs each thread over ranges of consecutive
    # panels (many panels: the ranges shrink towards the end), a short last panel, groups with
    # tails of 2 and 4 k pairs after the 8-pair steps; int8 / fp8 on their 4-panel tasks
    n, k = 16 * 75 + 7, 1920
    qw = random_qweight(kind, n, k, group, asym, seed=11)
    pw = packed_qweight.pack(qw, kernels)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            x = random_input(1, k, dtype, seed=5)
            bias = torch.randn(n)
            assert_close(qgemm.quantized_linear(x, pw, bias), x, qw, bias, kernels)
    finally:
        torch.set_num_threads(threads)


def test_symmetric_int4_streams_no_zero_points(kernels):
    # int4 zero points of 8 everywhere (GPTQ / AWQ symmetric) are the kernels' default: packed
    # without them (fewer bytes per decode step), the same product and dequantization
    qw = random_qweight("int4", 40, 256, 64, asym=False, seed=2)
    explicit = type(qw)(qw.kind, qw.qweight, qw.scales, torch.full_like(qw.scales, 8.0), qw.group_size,
                        qw.in_features, qw.input_perm, qw.act_quant)
    for w in (qw, explicit):
        pw = packed_qweight.pack(w, kernels)
        assert pw.zeros is None
        assert torch.equal(pw.dequantize(), qw.dequantize())
        for m in (1, 3, 9):
            x = random_input(m, 256, torch.bfloat16, seed=m)
            assert_close(qgemm.quantized_linear(x, pw), x, qw, None, kernels)
    asym = random_qweight("int4", 40, 256, 64, asym=True, seed=2)
    assert packed_qweight.pack(asym, kernels).zeros is not None
