"""torch_native backend: the C++ paged decode kernel and the pure-torch paths agree with a dense
reference on ragged batches (decodes + prefill chunks with cached prefixes), GQA, sliding windows."""
import numpy as np
import pytest
import torch

from pagedllm.attention import torch_native
from pagedllm.attention.backend import AttentionMetadata
from pagedllm.kernels import cpu as cpu_kernels


def make_batch(qlens, seqlens, H, Hkv, D, bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    qsl = np.zeros(len(qlens) + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    sl = np.array(seqlens, dtype=np.int64)
    maxb = -(-int(sl.max()) // bs)
    nb = max(512, len(qlens) * maxb)
    kv = torch.randn(2, nb, bs, Hkv, D, generator=g)
    table = rng.permutation(nb)[: len(qlens) * maxb].reshape(len(qlens), maxb).astype(np.int32)
    pos = np.concatenate([np.arange(s - q, s) for q, s in zip(qlens, seqlens)])
    req = np.repeat(np.arange(len(qlens)), qlens)
    slots = table[req, pos // bs].astype(np.int64) * bs + pos % bs
    T = int(qsl[-1])
    md = AttentionMetadata(T, torch.from_numpy(qsl.astype(np.int32)), torch.from_numpy(sl.astype(np.int32)),
                           torch.from_numpy(table), torch.from_numpy(slots), int(max(qlens)), int(sl.max()), qsl, sl)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, Hkv, Hkv))
    return kv, md, q, k, v, table, pos, req


def dense_reference(kv, md, q, k, v, table, H, Hkv, D, bs, window, soft_cap=None, alibi=None):
    kv = kv.clone()
    flat = kv.view(2, -1, Hkv, D)
    flat[0, md.slot_mapping] = k
    flat[1, md.slot_mapping] = v
    out = torch.empty_like(q)
    for i in range(md.num_reqs):
        a, b = int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1])
        L = int(md.seq_lens_cpu[i])
        ids = torch.from_numpy(table[i, : -(-L // bs)]).long()
        keys = kv[0][ids].reshape(-1, Hkv, D)[:L].repeat_interleave(H // Hkv, 1).transpose(0, 1)
        vals = kv[1][ids].reshape(-1, Hkv, D)[:L].repeat_interleave(H // Hkv, 1).transpose(0, 1)
        qpos = torch.arange(L - (b - a), L)[:, None]
        kpos = torch.arange(L)[None, :]
        visible = kpos <= qpos
        if window:
            visible &= qpos - kpos < window
        s = q[a:b].transpose(0, 1) @ keys.transpose(1, 2) * D**-0.5
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        if alibi is not None:
            s = s + alibi[:, None, None] * (kpos - qpos)
        s = s.masked_fill(~visible, float("-inf"))
        out[a:b] = (torch.softmax(s, -1) @ vals).transpose(0, 1)
    return out


CASES = [
    dict(qlens=[1] * 9, seqlens=[1, 5, 16, 17, 40, 64, 100, 3, 33]),
    dict(qlens=[1, 1, 7, 1, 300], seqlens=[20, 90, 7, 1, 340]),  # decodes, fresh prefill, chunk on a prefix
    dict(qlens=[260, 1], seqlens=[600, 600]),  # a chunk longer than one query chunk
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("fused_qkv", [False, True])
def test_matches_dense_reference(monkeypatch, case, H, Hkv, window, use_kernel, fused_qkv):
    if use_kernel and cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: kernel unavailable")
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "ready", lambda: None)
    D, bs = 32, 16
    kv, md, q, k, v, table, _, _ = make_batch(**CASES[case], H=H, Hkv=Hkv, D=D, bs=bs, seed=case)
    ref = dense_reference(kv, md, q, k, v, table, H, Hkv, D, bs, window)
    if fused_qkv:  # as the model passes them: strided row views into one qkv projection
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
        q, k, v = (t.view(-1, h, D) for t, h in zip(qkv.split([H * D, Hkv * D, Hkv * D], 1), (H, Hkv, Hkv)))
    impl = torch_native.TorchNativeAttention(H, Hkv, D, D**-0.5, window)
    out = impl.forward(q, k, v, kv, md)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("D,bs", [(32, 2), (64, 16), (128, 32)])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("case", [0, 1])
def test_kernel_bfloat16_cache_matches_float32_reference(D, bs, window, case):
    """The decode and prefill kernels read a bf16 cache and accumulate in float32: they must agree with the
    float32 reference computed from the same bf16-rounded values to within bf16 output rounding."""
    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: kernel unavailable")
    H, Hkv = 6, 2
    kv, md, q, k, v, table, _, _ = make_batch(**CASES[case], H=H, Hkv=Hkv, D=D, bs=bs, seed=7)
    kv, q, k, v = (t.to(torch.bfloat16) for t in (kv, q, k, v))
    ref = dense_reference(kv.float(), md, q.float(), k.float(), v.float(), table, H, Hkv, D, bs, window)
    impl = torch_native.TorchNativeAttention(H, Hkv, D, D**-0.5, window)
    out = impl.forward(q, k, v, kv, md)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("H,Hkv,D", [(8, 2, 40), (10, 2, 72), (2, 1, 96)])
def test_kernel_head_groups_and_dims(H, Hkv, D):
    """Query heads per kv head of 4 (two pairs), 5 (2 + 2 + 1) and 2, and head dims that leave a
    tail after the kernel's 32-dim value chunks (40, 72) or none (96)."""
    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: kernel unavailable")
    kv, md, q, k, v, table, _, _ = make_batch(**CASES[1], H=H, Hkv=Hkv, D=D, bs=16, seed=3)
    ref = dense_reference(kv, md, q, k, v, table, H, Hkv, D, 16, None)
    impl = torch_native.TorchNativeAttention(H, Hkv, D, D**-0.5, None)
    torch.testing.assert_close(impl.forward(q, k, v, kv, md), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", [0, 1])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("use_kernel,dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
def test_logit_soft_cap(monkeypatch, case, window, use_kernel, dtype):
    """Gemma 2's soft-capping (cap * tanh(score / cap) before the softmax), with a cap small enough
    to change the result, in the decode and prefill kernels and the torch paths."""
    if use_kernel and cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: kernel unavailable")
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "ready", lambda: None)
    H, Hkv, D, bs, cap = 6, 2, 32, 16, 1.5
    kv, md, q, k, v, table, _, _ = make_batch(**CASES[case], H=H, Hkv=Hkv, D=D, bs=bs, seed=11)
    q = q * 3  # scores well past the cap
    kv, q, k, v = (t.to(dtype) for t in (kv, q, k, v))
    args = (md, q.float(), k.float(), v.float(), table, H, Hkv, D, bs, window)
    ref = dense_reference(kv.float(), *args, soft_cap=cap)
    uncapped = dense_reference(kv.float(), *args)
    assert (ref - uncapped).abs().max() > 0.1
    out = torch_native.TorchNativeAttention(H, Hkv, D, D**-0.5, window, logits_soft_cap=cap).forward(q, k, v, kv, md)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi(case, H, Hkv, window, dtype):
    """ALiBi slopes (per query head, large enough to change the result) in the decode and prefill
    paths, with GQA / multi-query groups; the C++ kernels are bypassed for such layers."""
    D, bs = 32, 16
    kv, md, q, k, v, table, _, _ = make_batch(**CASES[case], H=H, Hkv=Hkv, D=D, bs=bs, seed=13)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(H)])
    kv, q, k, v = (t.to(dtype) for t in (kv, q, k, v))
    args = (md, q.float(), k.float(), v.float(), table, H, Hkv, D, bs, window)
    ref = dense_reference(kv.float(), *args, alibi=slopes)
    assert (ref - dense_reference(kv.float(), *args)).abs().max() > 0.1
    out = torch_native.TorchNativeAttentionBackend.make_impl(H, Hkv, D, D**-0.5, window, alibi_slopes=slopes).forward(
        q, k, v, kv, md)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
