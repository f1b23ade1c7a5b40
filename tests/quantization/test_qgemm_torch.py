"""The pure-torch quantized matmul (``torch_quantized_linear``, the path without kernels) against
the float64 product of ``QuantizedWeight.dequantize()``, and W8A8 against the exact integer
reference. Tolerances: float32 outputs 1e-5 of sum |x||w| (float32 summation); bf16 outputs
additionally one bf16 rounding of the result (2**-8 relative)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.quantization import qgemm
from qgemm_cases import int8_act_reference, random_input, random_qweight, reference

SHAPES = [(1, 64, 33), (5, 128, 17), (3, 256, 40)]  # (M, K, N): odd M, N not a multiple of 16


def check_close(y, ref, x, qw, out_dtype):
    bound = (x.double().abs() @ qw.dequantize().double().abs().t()) * 1e-5 + 1e-6
    if out_dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("group", [32, 64, -1])
@pytest.mark.parametrize("asym,perm", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only(kind, group, asym, perm, dtype):
    for m, k, n in SHAPES:
        if group != -1 and k % group:
            continue
        qw = random_qweight(kind, n, k, group, asym, perm, seed=m + k)
        x = random_input(m, k, dtype)
        bias = torch.randn(n)
        y = qgemm.torch_quantized_linear(x, qw, bias)
        assert y.dtype == dtype and y.shape == (m, n)
        check_close(y, reference(x, qw, bias), x, qw, dtype)


def test_leading_dims_and_float16():
    qw = random_qweight("int4", 24, 128, 32, asym=True)
    x = random_input(6, 128, torch.float16).reshape(2, 3, 128)
    y = qgemm.quantized_linear(x, qw)
    assert y.shape == (2, 3, 24) and y.dtype == torch.float16
    ref = reference(x.reshape(6, 128), qw).reshape(2, 3, 24)
    torch.testing.assert_close(y.double(), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("kind,asym", [("int8", False), ("int8", True), ("int4", False)])
@pytest.mark.parametrize("group", [64, -1])
def test_int8_activations_exact(kind, asym, group):
    qw = random_qweight(kind, 19, 256, group, asym, perm=True, act_quant="int8_per_token")
    x = random_input(7, 256, torch.float32)
    x[3] = 0.0  # an all-zero row quantizes to zeros, not NaN
    y = qgemm.torch_quantized_linear(x, qw)
    ref = int8_act_reference(x[:, qw.input_perm], random_qweight(kind, 19, 256, group, asym, act_quant=None))
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    assert (y[3] == 0).all()


@pytest.mark.parametrize("act_quant", ["fp8_per_token", "fp8_per_tensor"])
def test_fp8_activations(act_quant):
    qw = random_qweight("fp8", 21, 128, -1, act_quant=act_quant)
    x = random_input(5, 128, torch.bfloat16)
    y = qgemm.quantized_linear(x, qw)
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True) if act_quant == "fp8_per_token" else xf.abs().amax()
    s = amax / 448.0
    xq = (xf / s).to(torch.float8_e4m3fn).double() * s.double()
    ref = xq @ qw.dequantize().double().t()
    check_close(y, ref, x, qw, torch.bfloat16)


def test_wrong_width_refused():
    qw = random_qweight("int8", 8, 64)
    with pytest.raises(ValueError, match="features"):
        qgemm.quantized_linear(torch.randn(2, 32), qw)
