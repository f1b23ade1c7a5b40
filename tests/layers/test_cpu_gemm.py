"""Packed CPU linear weights (layers/cpu_gemm.py): pagedllm's packed GEMM (kernels/csrc/packed_gemm.h)
and the oneDNN fallback compute the same products as F.linear -- on every GEMM path this CPU can
run (scalar, avx2, avx512, avx512_bf16: each ISA level's build, the others skipped naming the CPU
flags they need), every row count regime (the decode-sized and the blocked prefill-sized loop,
microkernel row tails), column counts that are not a multiple of the 16-column panel or of the
microkernel's panels, odd K and K blocks with tails, bias, float32 and bf16 weights and
activations -- and tied LM heads keep a dense embedding table."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.layers import cpu_gemm
from kernel_levels import kernels_at_level


def reference(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


# ISA level -> the GEMM path its build compiles (gemm_path()).
GEMM_PATHS = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512_bf16"}


@pytest.fixture(scope="module", params=list(GEMM_PATHS))
def level_kernels(request):
    """The kernels built for one ISA level, skipped where this CPU lacks the level's flags."""
    module = kernels_at_level(request.param)
    assert module.gemm_path() == GEMM_PATHS[request.param]
    return module


def test_loaded_kernels_report_their_gemm_path(kernels):
    assert kernels.gemm_path() in GEMM_PATHS.values()
    assert kernels.gemm_path() == GEMM_PATHS.get(kernels.isa, "avx512_bf16")  # amx builds use avx512_bf16


def _check(y, x, w, bias, kernels):
    """y against float64 products of the inputs as the path rounds them: with bf16 weights the
    avx512_bf16 path multiplies bf16 x (x rounded to bf16 once), the others x as given. float32
    output: float32 accumulation error only; bf16 output: plus one rounding."""
    xr = x.to(torch.bfloat16) if w.dtype == torch.bfloat16 and kernels.gemm_path() == "avx512_bf16" else x
    exact = reference(xr, w, bias)
    scale = F.linear(xr.double().abs(), w.double().abs())  # sum of |x w| per output
    bound = 1e-6 * scale + 1e-6
    if y.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, worst bound excess {(err - bound).max():.3g}"


SHAPES = [(96, 48), (40, 301), (13, 24), (1, 7), (100, 777), (600, 40), (50, 520)]  # (N, K)


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 8, 64, 96, 97, 300])
def test_every_gemm_path_matches_the_rounded_inputs_product(level_kernels, rows):
    for n, k in SHAPES:
        g = torch.Generator().manual_seed(rows * 1000 + n + k)
        w32 = torch.randn(n, k, generator=g)
        x32 = torch.randn(rows, k, generator=g)
        b = torch.randn(n, generator=g)
        for wdt in (torch.float32, torch.bfloat16):
            w = w32.to(wdt)
            packed = cpu_gemm.pack_panels(w, level_kernels)
            assert packed.panel_out_features == n and packed.panel_kernels is level_kernels
            assert packed.dtype == wdt  # no float32 copy of a bf16 weight
            if wdt == torch.bfloat16 and level_kernels.gemm_path() == "avx512_bf16":
                assert packed.shape == (-(-n // 16), -(-k // 2), 32)  # k in pairs for vdpbf16ps
            else:
                assert packed.shape == (-(-n // 16), k, 16)
            for xdt in (torch.float32, torch.bfloat16):
                x = x32.to(xdt)
                for bias in (None, b):
                    y = cpu_gemm.linear(x, packed, bias)
                    assert y.shape == (rows, n) and y.dtype == xdt
                    _check(y, x, w, bias, level_kernels)


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 64, 96, 97, 200])
@pytest.mark.parametrize("n,k", [(96, 48), (40, 300), (13, 24), (1, 8), (48, 520)])
def test_panel_gemm_matches_f_linear(kernels, rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    packed = cpu_gemm.pack_panels(w)
    assert packed.shape == (-(-n // 16), k, 16) and packed.panel_out_features == n
    for bias in (None, b):
        y = cpu_gemm.linear(x, packed, bias)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), reference(x, w, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 9, 130])
def test_panel_gemm_bfloat16_weights_accumulate_in_float32(kernels, rows):
    """A bf16 layer takes and returns bf16 and equals the float32-accumulated product of the bf16
    values, rounded once to bf16 (what a native bf16 GEMM computes)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(72, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(72, generator=g).to(torch.bfloat16)
    packed = cpu_gemm.pack_panels(w)
    assert packed.dtype == torch.bfloat16  # no float32 copy of the weight
    y = cpu_gemm.linear(x, packed, b)
    assert y.dtype == torch.bfloat16
    exact = reference(x, w, b)
    assert (y.double() - exact).abs().max() <= (exact.abs() * 2**-8).max() + 1e-6  # one bf16 rounding


def test_panel_gemm_leading_dims_and_strided_input(kernels):
    w = torch.randn(32, 16)
    packed = cpu_gemm.pack_panels(w)
    x = torch.randn(5, 48)[:, 16:32]  # a split view, as q/k/v slices are
    torch.testing.assert_close(cpu_gemm.linear(x, packed), x @ w.t(), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 3, 16)
    torch.testing.assert_close(cpu_gemm.linear(x3, packed), x3 @ w.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
def test_panel_gemm_any_thread_count(kernels, threads):
    """Threads split the panels; fewer panels than threads leaves some idle, never wrong."""
    w = torch.randn(40, 64)
    x = torch.randn(11, 64)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = cpu_gemm.linear(x, cpu_gemm.pack_panels(w))
    finally:
        torch.set_num_threads(prev)
    torch.testing.assert_close(y.double(), reference(x, w), atol=1e-4, rtol=1e-5)


def test_panel_gemm_rejects_mismatched_shapes(kernels):
    packed = cpu_gemm.pack_panels(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="packed"):
        kernels.packed_linear(torch.randn(3, 24), packed, 32, None)
    with pytest.raises(RuntimeError, match="packed"):
        kernels.packed_linear(torch.randn(3, 16), packed, 48, None)  # N of another weight
    with pytest.raises(RuntimeError, match="bias"):
        kernels.packed_linear(torch.randn(3, 16), packed, 32, torch.randn(31))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 x"):
        kernels.packed_linear(torch.randn(3, 16).double(), packed, 32, None)


onednn = pytest.mark.skipif(not cpu_gemm.packing_available(), reason="torch built without oneDNN")


@onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_fallback_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 48, generator=g)
    packed = cpu_gemm.pack_weight(w, torch.float32)
    assert packed.is_mkldnn and packed.shape == w.shape
    torch.testing.assert_close(cpu_gemm.linear(x, packed, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@onednn
def test_onednn_fallback_bfloat16_is_bf16_in_bf16_out():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(9, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(64, generator=g).to(torch.bfloat16)
    compute = cpu_gemm.packed_compute_dtype(torch.bfloat16)
    y = cpu_gemm.linear(x, cpu_gemm.pack_weight(w, compute), b)
    assert y.dtype == torch.bfloat16
    ref = (x.float() @ w.float().t()).to(torch.bfloat16).float() + b.float()
    torch.testing.assert_close(y.float(), ref, atol=0.06, rtol=0.02)


class _Head(nn.Module):
    packable_weight = True

    def __init__(self, weight):
        super().__init__()
        self.weight = weight


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = _Head(self.embed.weight)  # tied


def _check_tied(toy, before):
    assert not toy.embed.weight.is_mkldnn and torch.equal(toy.embed.weight, before)
    h = torch.randn(3, 16)
    torch.testing.assert_close(cpu_gemm.linear(h, toy.head.weight), h @ before.t(), atol=1e-5, rtol=1e-5)


def test_pack_linear_weights_uses_panels_and_keeps_tied_embedding_dense(kernels):
    toy = _Toy().requires_grad_(False)
    before = toy.embed.weight.clone()
    assert cpu_gemm.pack_linear_weights(toy, torch.float32) == 1
    assert toy.head.weight.panel_out_features == 50
    _check_tied(toy, before)
    assert cpu_gemm.pack_linear_weights(toy, torch.float32) == 0  # idempotent


@onednn
def test_pack_linear_weights_without_kernels_uses_onednn(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "ready", lambda: None)  # what the worker sees with cpu_kernels off
    toy = _Toy().requires_grad_(False)
    before = toy.embed.weight.clone()
    assert cpu_gemm.pack_linear_weights(toy, torch.float32) == 1
    assert toy.head.weight.is_mkldnn
    _check_tied(toy, before)
