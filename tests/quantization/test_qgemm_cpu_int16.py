"""The int16-activation path of the weight-only quantized matmuls (kernels/csrc/quant_gemm_i16.h):
float32 x quantized per row to int16 and multiplied with vpdpwssd on CPUs with
AVX512-VNNI and VBMI. Against the definition (x rounded as int16_rounded says, times the
dequantized weight, in float64): within float32 rounding of the chunk sums (1e-6 of sum |x||w|);
against unrounded x: within the rounding (half a step of each row's scale per element). Cases:
batch 1 (one stream per range of panels, 8-line and 4-pair steps with tails), batches (one and
more 8-row tiles, row tails, the 3-panel tasks), int4 and int8 codes, groups of 2 / 6 / 16 / 32 /
64 k and per-channel groups cut into 256-k chunks, zero points, act-order; a chunk of zeros; a
non-finite input comes out NaN in its row only; the switch; bf16 x keeps its own paths; prompt-sized
batches in passes of 64 rows."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import isa
from pagedllm.quantization import packed_qweight, qgemm
from qgemm_cases import int16_rounded, random_input, random_qweight, reference


@pytest.fixture
def kernels16(kernels):
    if not kernels.int16_activations():
        pytest.skip("the int16 path needs an AVX-512 build on a CPU with AVX512-VNNI and AVX512-VBMI")
    return kernels


def test_on_where_the_cpu_has_it(kernels):
    flags = isa.cpu_flags()
    expected = kernels.isa in ("avx512", "avx512_bf16", "amx") and {"avx512_vnni", "avx512vbmi"} <= flags
    assert kernels.int16_activations() == expected


def check(y, x, qw, bias=None):
    dense = qw.dequantize().double()
    bound = (x.double().abs() @ dense.abs().t()) * 1e-6 + 1e-6
    exact = reference(int16_rounded(x, qw), qw, bias)
    assert ((y.double() - exact).abs() <= bound).all(), f"max excess {((y.double() - exact).abs() - bound).max()}"
    # the rounding itself: at most half a step of its row's scale per element
    step = (x.abs().amax(dim=1, keepdim=True).double() / 32767.0 / 2).expand(x.shape)
    rounding = step @ dense.abs().t() + bound
    assert ((y.double() - reference(x, qw, bias)).abs() <= rounding).all()


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("k,group,asym,perm", [(120, 2, False, False), (120, 6, True, False), (256, 16, False, True),
                                               (576, 32, True, False), (576, 32, False, False), (512, 64, True, True),
                                               (520, -1, False, False), (768, -1, True, False)])
def test_matches_the_definition(kernels16, kind, k, group, asym, perm):
    n = 16 * 7 + 5
    qw = random_qweight(kind, n, k, group, asym, perm, seed=k + n + (group if group > 0 else 0))
    pw = packed_qweight.pack(qw, kernels16)
    for m in (1, 2, 4, 5, 8, 16, 17):
        x = random_input(m, k, torch.float32, seed=m)
        bias = torch.randn(n) if m % 2 else None
        y = qgemm.quantized_linear(x, pw, bias)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        check(y, x, qw, bias)


@pytest.mark.parametrize("kind,group", [("int4", 32), ("int8", 32), ("int4", 128)])
def test_decode_ranges_on_two_threads(kernels16, kind, group):
    n, k = 16 * 75 + 7, 1536
    qw = random_qweight(kind, n, k, group, asym=kind == "int4", seed=3)
    pw = packed_qweight.pack(qw, kernels16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = random_input(1, k, torch.float32, seed=9) * 3.0
        bias = torch.randn(n)
        check(qgemm.quantized_linear(x, pw, bias), x, qw, bias)
    finally:
        torch.set_num_threads(threads)


def test_zero_chunks_and_non_finite_rows(kernels16):
    qw = random_qweight("int4", 40, 128, 32, asym=True, seed=5)
    pw = packed_qweight.pack(qw, kernels16)
    x = random_input(6, 128, torch.float32, seed=2)
    x[1, 32:64] = 0.0  # a chunk of zeros: scale 1, codes 0
    x[2] = 0.0
    check(qgemm.quantized_linear(x, pw), x, qw)
    x[3, 70] = float("inf")
    x[4, 5] = float("nan")
    y = qgemm.quantized_linear(x, pw)
    assert y[3].isnan().all() and y[4].isnan().all()
    keep = [0, 1, 2, 5]
    check(y[keep], x[keep], qw)


def test_switch_and_bf16(kernels16):
    qw = random_qweight("int4", 48, 256, 32, asym=True, seed=1)
    pw = packed_qweight.pack(qw, kernels16)
    x = random_input(5, 256, torch.float32, seed=4)
    on = qgemm.quantized_linear(x, pw)
    try:
        assert kernels16.int16_activations(False) is False
        off = qgemm.quantized_linear(x, pw)  # the float32 path: x unrounded
        ref = reference(x, qw)
        assert ((off.double() - ref).abs() <= (x.double().abs() @ qw.dequantize().double().abs().t()) * 1e-5).all()
        assert not torch.equal(on, off)
    finally:
        assert kernels16.int16_activations(True) is True
    assert torch.equal(qgemm.quantized_linear(x, pw), on)
    xb = x.bfloat16()  # bf16 x: its bf16 paths, the same whether the switch is on or off
    yb = qgemm.quantized_linear(xb, pw)
    kernels16.int16_activations(False)
    try:
        assert torch.equal(qgemm.quantized_linear(xb, pw), yb)
    finally:
        kernels16.int16_activations(True)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_prompt_sized_batches(kernels16, kind):
    # more rows than one 64-row pass: every pass widens the chunks again, a short last pass
    qw = random_qweight(kind, 16 * 3 + 9, 256, 32, asym=kind == "int4", seed=8)
    pw = packed_qweight.pack(qw, kernels16)
    x = random_input(150, 256, torch.float32, seed=6)
    bias = torch.randn(qw.out_features)
    y = qgemm.quantized_linear(x, pw, bias)
    check(y, x, qw, bias)
    assert torch.equal(qgemm.quantized_linear(x[64:], pw, bias), y[64:])  # rows do not see each other
