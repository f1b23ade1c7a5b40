"""Packed oneDNN linear weights (layers/cpu_gemm.py): same products as F.linear, bf16 semantics
kept on CPUs without native bf16, tied LM heads keep a dense embedding table."""
import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.packing_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_float32_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 48, generator=g)
    packed = cpu_gemm.pack_weight(w, torch.float32)
    assert packed.is_mkldnn and packed.shape == w.shape
    torch.testing.assert_close(cpu_gemm.linear(x, packed, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_non_contiguous_input_view():
    w = torch.randn(32, 16)
    x = torch.randn(5, 48)[:, 16:32]  # a split view, as q/k/v slices are
    torch.testing.assert_close(cpu_gemm.linear(x, cpu_gemm.pack_weight(w, torch.float32)), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_bfloat16_model_is_bf16_in_bf16_out_with_float32_accumulation():
    """Whatever the CPU packs bf16 weights as, a bf16 layer takes and returns bf16 and equals a
    float32-accumulated product of the bf16 values, rounded once to bf16."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(9, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(64, generator=g).to(torch.bfloat16)
    compute = cpu_gemm.packed_compute_dtype(torch.bfloat16)
    y = cpu_gemm.linear(x, cpu_gemm.pack_weight(w, compute), b)
    assert y.dtype == torch.bfloat16
    ref = (x.float() @ w.float().t()).to(torch.bfloat16).float() + b.float()
    torch.testing.assert_close(y.float(), ref, atol=0.06, rtol=0.02)


def test_pack_linear_weights_keeps_tied_embedding_dense():
    from torch import nn

    class Head(nn.Module):
        packable_weight = True

        def __init__(self, weight):
            super().__init__()
            self.weight = weight

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.head = Head(self.embed.weight)  # tied

    toy = Toy().requires_grad_(False)
    before = toy.embed.weight.clone()
    assert cpu_gemm.pack_linear_weights(toy, torch.float32) == 1
    assert toy.head.weight.is_mkldnn and not toy.embed.weight.is_mkldnn
    assert torch.equal(toy.embed.weight, before)
    h = torch.randn(3, 16)
    torch.testing.assert_close(cpu_gemm.linear(h, toy.head.weight), h @ before.t(), atol=1e-5, rtol=1e-5)
