"""GGUF blocks rewritten into the quantized-GEMM panels (quantization/gguf_panels.py): for every
type with a panel form, the equivalent QuantizedWeight dequantizes to gguf-py's reference values
(float32 rounding of the zero point aside), constant groups (a zero scale) included; the panels
multiply like the reference; embedding rows read back from the panels equal the reference rows."""
from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf_files import random_blocks, reference_dequantize  # noqa: E402
from pagedllm.quantization import gguf_panels  # noqa: E402
from pagedllm.quantization.qgemm import quantized_linear  # noqa: E402
from qgemm_cases import kernel_input  # noqa: E402


@pytest.mark.parametrize("type_name", gguf_panels.PANEL_TYPES)
def test_same_weights(type_name):
    n, k = 37, 512
    blocks = random_blocks(type_name, n, k, seed=3, dead_groups=True)
    ref = reference_dequantize(blocks, type_name)
    qw = gguf_panels.to_quantized_weight(torch.from_numpy(blocks), type_name, k)
    torch.testing.assert_close(qw.dequantize(), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("type_name", gguf_panels.PANEL_TYPES)
def test_panels_multiply_and_read_rows(kernels, type_name):
    n, k = 45, 768
    blocks = random_blocks(type_name, n, k, seed=4, dead_groups=True)
    ref = reference_dequantize(blocks, type_name).double()
    pw = gguf_panels.to_panels(torch.from_numpy(blocks), type_name, k, kernels)
    assert pw is not None
    for m in (1, 3, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = kernel_input(x, pw, kernels).double() @ ref.t()  # the int16 path: x as it rounds it
        bound = (x.double().abs() @ ref.abs().t()) * 2e-6 + 1e-6
        assert ((quantized_linear(x, pw).double() - want).abs() <= bound).all()
    rows = torch.tensor([0, 44, 16, 17, 16])
    torch.testing.assert_close(gguf_panels.panel_rows(pw, rows), ref[rows].float(), rtol=1e-6, atol=1e-7)


def test_types_without_panels_stay(kernels):
    blocks = random_blocks("Q5_K", 16, 256, seed=0)
    assert gguf_panels.to_panels(torch.from_numpy(blocks), "Q5_K", 256, kernels) is None
