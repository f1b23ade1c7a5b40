"""The Triton weight-only quantized matmul (quantization/triton_qgemm.py) against the float64
product of ``QuantizedWeight.dequantize()``: int8 and int4, group sizes 32 / 64 / K, asymmetric
zero points, act-order, odd M and N past the tile. Without CUDA it runs under the Triton
interpreter (``TRITON_INTERPRET=1``, CPU tensors, float32 and float16 x); with CUDA, compiled,
and with bf16 x too.

Tolerances: float32 x (IEEE dots) 1e-5 of sum |x||w|; fp16/bf16 x: the dequantized weight is
rounded to x's dtype before the dot (as a dense half-precision GEMM holds it), so one rounding of
each weight (2**-11 fp16, 2**-8 bf16 relative) of sum |x||w|, plus one rounding of the output."""
from __future__ import annotations

import pytest
import torch

import triton_mode
from triton_mode import NATIVE

_ENV = triton_mode.enter()
try:
    from pagedllm.quantization import triton_qgemm
finally:
    _ENV.restore()
triton_mode.skip_unless_interpreted(triton_qgemm._qgemm_kernel, "triton_qgemm", _ENV)

from qgemm_cases import random_input, random_qweight, reference  # noqa: E402

DEVICE = torch.device("cuda" if NATIVE else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if NATIVE else [])
WEIGHT_ROUNDING = {torch.float32: 1e-5, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.fixture(autouse=True, scope="module")
def _interpret_env():
    _ENV.set()
    yield
    _ENV.restore()


def _to(qw, device):
    from pagedllm.quantization.quantized_weight import QuantizedWeight

    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return QuantizedWeight(qw.kind, move(qw.qweight), move(qw.scales), move(qw.zeros), qw.group_size, qw.in_features,
                           move(qw.input_perm), qw.act_quant)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("group,asym,perm", [(32, False, False), (64, True, True), (-1, True, False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_dequantized_reference(kind, group, asym, perm, dtype):
    m, k, n = 5, 128, 40
    qw = random_qweight(kind, n, k, group, asym, perm, seed=k + n)
    x = random_input(m, k, dtype)
    bias = torch.randn(n)
    y = triton_qgemm.quantized_linear(x.to(DEVICE), _to(qw, DEVICE), bias.to(DEVICE)).cpu()
    assert y.dtype == dtype and y.shape == (m, n)
    ref = reference(x, qw, bias)
    bound = (x.double().abs() @ qw.dequantize().double().abs().t()) * WEIGHT_ROUNDING[dtype] + 1e-5
    if dtype != torch.float32:
        bound = bound + ref.abs() * (2.0**-11 if dtype == torch.float16 else 2.0**-8)
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def test_group_sizes_it_cannot_tile_are_refused():
    qw = random_qweight("int8", 16, 24, 24)
    assert triton_qgemm.block_k(24) is None
    with pytest.raises(ValueError, match="multiple of 16"):
        triton_qgemm.quantized_linear(torch.randn(2, 24, device=DEVICE), _to(qw, DEVICE))
