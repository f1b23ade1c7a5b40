"""The C++ quantized matmuls (kernels/csrc/quant_gemm.h, quant_gemm_i8.h) for every ISA level this
CPU runs, through qgemm.quantized_linear on weights packed by packed_qweight.pack, against the
float64 product of ``QuantizedWeight.dequantize()`` (weight-only) or the exact integer W8A8
reference. Tolerances: float32 outputs 1e-5 of sum |x||w| (float32 sums of exact code products,
scales applied per group); bf16 outputs additionally one bf16 rounding of the result (2**-8
relative). Shapes: odd M, M past the 4-row direct microkernel (batches take the blocked path:
codes widened once per chunk, bf16 x multiplied with vdpbf16ps where the build has it), N not a
multiple of the 16-row panel or of the 2-, 3- and 4-panel tasks, groups of 32 / 64 / 128 / K (K
summed in chunks of 256), act-order, asymmetric zero points. Where float32 x takes the int16 path
(quant_gemm_i16.h) the reference multiplies x as that path rounds it (test_qgemm_cpu_int16.py)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels import isa
from pagedllm.quantization import packed_qweight, qgemm
from qgemm_cases import int8_act_reference, kernel_input, random_input, random_qweight, reference
from kernel_levels import kernels_at_level

LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]
SHAPES = [(1, 128, 33), (5, 256, 70), (9, 128, 16), (6, 768, 50)]  # (M, K, N); K 768: groups of K in 256-k chunks


@pytest.fixture(scope="module", params=LEVELS)
def level_kernels(request):
    return kernels_at_level(request.param)


def check_close(y, ref, x, qw, out_dtype):
    bound = (x.double().abs() @ qw.dequantize().double().abs().t()) * 1e-5 + 1e-6
    if out_dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("group,asym,perm", [(32, False, False), (64, True, True), (128, True, False),
                                             (-1, False, True), (-1, True, False)])
def test_weight_only(level_kernels, kind, group, asym, perm):
    for m, k, n in SHAPES:
        qw = random_qweight(kind, n, k, group, asym, perm, seed=m + k + n)
        pw = packed_qweight.pack(qw, level_kernels)
        assert torch.equal(pw.dequantize(), qw.dequantize())
        for dtype in (torch.float32, torch.bfloat16):
            x = random_input(m, k, dtype, seed=m)
            bias = torch.randn(n) if m % 2 else None
            y = qgemm.quantized_linear(x, pw, bias)
            assert y.dtype == dtype and y.shape == (m, n)
            check_close(y, reference(kernel_input(x, qw, level_kernels), qw, bias), x, qw, dtype)


@pytest.mark.parametrize("act_quant", ["fp8_per_token", "fp8_per_tensor"])
def test_fp8_activations_match_the_torch_path(level_kernels, act_quant):
    qw = random_qweight("fp8", 40, 128, -1, act_quant=act_quant)
    pw = packed_qweight.pack(qw, level_kernels)
    x = random_input(6, 128, torch.float32)
    y = qgemm.quantized_linear(x, pw)
    ref = qgemm.torch_quantized_linear(x, qw).double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group,asym", [(32, False), (64, True), (-1, False), (-1, True)])
def test_int8_activations_exact(level_kernels, group, asym):
    for m, k, n in SHAPES:
        qw = random_qweight("int8", n, k, group, asym, perm=True, act_quant="int8_per_token", seed=n)
        pw = packed_qweight.pack(qw, level_kernels)
        assert pw.int8_activations and torch.equal(pw.dequantize(), qw.dequantize())
        x = random_input(m, k, torch.float32, seed=k)
        x[0, :7] = 0.5  # ties: round half to even, as the reference
        ref = int8_act_reference(x[:, qw.input_perm], random_qweight("int8", n, k, group, asym, seed=n))
        # the integer sums are exact; what differs is float32 rounding: the reference rounds each
        # dequantized weight, the kernel each group's scaled sum (1e-6 of sum |q_x s_x| |w|)
        bound = 1e-6 * (x.double().abs() @ qw.dequantize().double().abs().t()) + 1e-7
        for vnni in (True, False):  # vpdpbusd (where the build and CPU have it) and the integer loops
            y = level_kernels.quant_linear_i8(x, pw.packed, pw.scales, pw.zeros, pw.colsum, n, pw.group_size,
                                              pw.input_perm, None, vnni)
            assert ((y.double() - ref).abs() <= bound).all()
        yb = qgemm.quantized_linear(x.bfloat16(), pw)
        assert yb.dtype == torch.bfloat16


def test_vnni_used_where_the_cpu_has_it(kernels):
    expected = kernels.isa in ("avx512", "avx512_bf16", "amx") and "avx512_vnni" in isa.cpu_flags()
    assert kernels.int8_dot_vnni() == expected


def test_prepare_packs_and_keeps_quantized_size(kernels, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "ready", lambda: kernels)
    qw = random_qweight("int4", 96, 256, 128, asym=True, perm=True)
    pw = qgemm.prepare(qw)
    assert isinstance(pw, packed_qweight.PackedQuantizedWeight) and pw.kernels is kernels
    assert pw.nbytes() == qw.nbytes()  # N a multiple of 16: no padding, the same bytes rearranged
    assert (pw.in_features, pw.out_features, pw.kind) == (256, 96, "int4")
    odd = random_qweight("int8", 8, 30, 30, act_quant="int8_per_token")  # groups not a multiple of 4
    assert qgemm.prepare(odd) is odd
    monkeypatch.setattr(cpu_kernels, "ready", lambda: None)
    assert qgemm.prepare(qw) is qw


def test_threads_and_leading_dims(kernels):
    qw = random_qweight("int8", 77, 128, 64, asym=True)
    pw = packed_qweight.pack(qw, kernels)
    x = random_input(12, 128, torch.float32).reshape(3, 4, 128)
    want = qgemm.quantized_linear(x, pw)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qgemm.quantized_linear(x, pw), want)  # tasks split by panels: the same sums
    finally:
        torch.set_num_threads(threads)
    assert want.shape == (3, 4, 77)
    x2 = x.reshape(12, 128)
    check_close(want.reshape(12, 77), reference(kernel_input(x2, qw, kernels), qw), x2, qw, torch.float32)


def test_bad_inputs_refused(kernels):
    qw = random_qweight("int8", 16, 64)
    pw = packed_qweight.pack(qw, kernels)
    with pytest.raises(ValueError, match="features"):
        qgemm.quantized_linear(torch.randn(2, 32), pw)
    with pytest.raises(RuntimeError, match="packed"):
        kernels.quant_linear(torch.randn(2, 64), pw.packed, 0, pw.scales, None, 32, 64)  # N of another weight
