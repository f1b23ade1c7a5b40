"""The fused C++ CPU ops agree with the torch code they replace (float32 tightly; bfloat16 within
rounding), including odd sizes (scalar tails) and strided rows."""
import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, _rotate_half, apply_rotary


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def rms_reference(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 8), (5, 100), (70, 768)])
def test_rms_norm_and_fused_add(kernels, dtype, rows, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    out = torch.empty_like(x)
    kernels.rms_norm(out, x, w, 1e-6)
    torch.testing.assert_close(out.float(), rms_reference(x, w, 1e-6).float(), **tol(dtype))
    want_res = x + res
    want = rms_reference(want_res, w, 1e-6)
    x2, r2 = x.clone(), res.clone()
    kernels.fused_add_rms_norm(x2, r2, w, 1e-6)
    assert torch.equal(r2, want_res)  # the residual sum is rounded exactly like torch's add
    torch.testing.assert_close(x2.float(), want.float(), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 4), (3, 37), (40, 2048)])
def test_silu_and_mul(kernels, dtype, rows, inter):
    x = (torch.randn(rows, 2 * inter) * 4).to(dtype)
    out = torch.empty(rows, inter, dtype=dtype)
    kernels.silu_and_mul(out, x)
    gate, up = x.float().chunk(2, -1)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, **tol(dtype))
    extreme = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=dtype)
    out = torch.empty(1, 5, dtype=dtype)
    kernels.silu_and_mul(out, torch.cat([extreme[:, :5], extreme[:, :5].new_ones(1, 5)], 1))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), F.silu(extreme[:, :5].float()), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 20])
def test_rotary_inplace_on_strided_views(kernels, dtype, head_dim):
    T, Hq, Hkv = 9, 4, 2
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    positions = torch.randint(0, 64, (T,))
    cos, sin = rope.cos_sin(positions, dtype)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * head_dim).to(dtype)
    q = qkv[:, : Hq * head_dim].view(T, Hq, head_dim)
    k = qkv[:, Hq * head_dim : (Hq + Hkv) * head_dim].view(T, Hkv, head_dim)
    want_q = q.float() * cos.float() + _rotate_half(q.float()) * sin.float()
    want_k = k.float() * cos.float() + _rotate_half(k.float()) * sin.float()
    v_before = qkv[:, (Hq + Hkv) * head_dim :].clone()
    rq, rk = apply_rotary((cos, sin), q, k)
    torch.testing.assert_close(rq.float(), want_q, **tol(dtype))
    torch.testing.assert_close(rk.float(), want_k, **tol(dtype))
    assert torch.equal(qkv[:, (Hq + Hkv) * head_dim :], v_before)  # v untouched


def test_write_kv_matches_index_copy_and_skips_negative_slots(kernels):
    Hkv, D, nb, bs = 2, 8, 6, 4
    cache = torch.zeros(2, nb, bs, Hkv, D)
    kv = torch.randn(5, 3 * Hkv * D)  # k and v as strided views of one projection
    key = kv[:, Hkv * D : 2 * Hkv * D].view(5, Hkv, D)
    value = kv[:, 2 * Hkv * D :].view(5, Hkv, D)
    slots = torch.tensor([3, 0, 17, -1, 23])
    kernels.write_kv(cache[0], cache[1], key, value, slots)
    want = torch.zeros_like(cache)
    keep = slots >= 0
    want[0].view(-1, Hkv, D).index_copy_(0, slots[keep], key[keep])
    want[1].view(-1, Hkv, D).index_copy_(0, slots[keep], value[keep])
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.write_kv(cache[0], cache[1], key, value, torch.tensor([0, 1, 2, 3, nb * bs]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_use_kernels_and_match_torch_path(monkeypatch, kernels, dtype):
    """RMSNorm (with and without residual) and SiluAndMul give the same result on both paths."""
    x = torch.randn(6, 96).to(dtype)
    res = torch.randn(6, 96).to(dtype)
    norm = RMSNorm(96).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    act = SiluAndMul()
    fast = (norm(x.clone()), *norm(x.clone(), res.clone()), act(x))
    monkeypatch.setattr(cpu_kernels, "ready", lambda: None)
    slow = (norm(x.clone()), *norm(x.clone(), res.clone()), act(x))
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a.float(), b.float(), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 8, 100, 32000])
def test_argmax_rows_matches_torch_first_maximum_and_nan(kernels, vocab, dtype):
    from pagedllm.sample.sampler import greedy

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(10, vocab, generator=g).to(dtype)  # bf16: many ties after rounding
    x[1] = x[1].round()  # ties: the first maximum wins
    x[2] = float("-inf")
    if vocab > 3:
        x[3, 3] = float("nan")
        x[4, vocab - 1] = 1e30  # in the scalar tail when vocab % 8 != 0
    x[5] = -x[5].abs() - 1  # every logit negative (bf16 compares their bits as ordered integers)
    x[6] = -0.0  # a zero maximum: -0 == +0, so the first zero of either sign
    x[6, vocab // 2] = 0.0
    x[7] = -1.0
    x[7, vocab // 3] = -0.0
    x[8, vocab - 1] = -float("nan")  # a NaN with its sign bit set
    x[9] = 0.0
    out = torch.empty(10, dtype=torch.long)
    kernels.argmax_rows(out, x)
    assert torch.equal(out, x.argmax(dim=-1))
    assert torch.equal(greedy(x), x.argmax(dim=-1))
    assert torch.equal(greedy(x[:, : max(1, vocab // 2)]), x[:, : max(1, vocab // 2)].argmax(dim=-1))  # strided rows
