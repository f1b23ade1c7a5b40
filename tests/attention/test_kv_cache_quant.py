"""8-bit KV cache (kv_cache_dtype int8 / fp8_e4m3 / fp8_e5m2): the reference quantizer, the C++
write kernel byte for byte against it, and the decode/prefill kernels and the pure-torch paths
against a dense float32 attention over the dequantized cache (ragged batches: decodes, a fresh
prefill, a chunk on a cached prefix; GQA; a sliding window), with large-magnitude activations."""
import numpy as np
import pytest
import torch

from pagedllm.attention import kv_quant, torch_native
from pagedllm.attention.backend import AttentionMetadata
from pagedllm.kernels import cpu as cpu_kernels

NAMES = ("int8", "fp8_e4m3", "fp8_e5m2")
CASES = [
    dict(qlens=[1] * 6, seqlens=[1, 5, 16, 17, 40, 100]),
    dict(qlens=[1, 1, 7, 1, 40], seqlens=[20, 90, 7, 1, 75]),  # decodes, fresh prefill, chunk on a prefix
]


def make_step(qlens, seqlens, H, Hkv, D, bs, spec, seed=0, magnitude=1.0):
    """A step over an 8-bit cache whose every slot already holds quantized random K/V."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    qsl = np.zeros(len(qlens) + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    sl = np.array(seqlens, dtype=np.int64)
    maxb = -(-int(sl.max()) // bs)
    nb = len(qlens) * maxb + 3
    table = rng.permutation(nb)[: len(qlens) * maxb].reshape(len(qlens), maxb).astype(np.int32)
    pos = np.concatenate([np.arange(s - q, s) for q, s in zip(qlens, seqlens)])
    req = np.repeat(np.arange(len(qlens)), qlens)
    slots = table[req, pos // bs].astype(np.int64) * bs + pos % bs
    T = int(qsl[-1])
    md = AttentionMetadata(T, torch.from_numpy(qsl.astype(np.int32)), torch.from_numpy(sl.astype(np.int32)),
                           torch.from_numpy(table), torch.from_numpy(slots), int(max(qlens)), int(sl.max()), qsl, sl)
    cache = torch.zeros(2, nb, bs, Hkv, D, dtype=spec.dtype)
    scales = torch.zeros(2, nb, bs, Hkv, dtype=kv_quant.SCALE_DTYPE)
    every = torch.arange(nb * bs)
    for p in range(2):  # the cached prefixes
        kv_quant.write_quantized(cache[p], scales[p], torch.randn(nb * bs, Hkv, D, generator=g) * magnitude, every, spec)
    q, k, v = (torch.randn(T, h, D, generator=g) * magnitude for h in (H, Hkv, Hkv))
    return cache, scales, md, q, k, v, table


def dense_reference(cache, scales, md, q, table, H, Hkv, D, bs, window):
    """float32 attention over the dequantized cache (after the step's write)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(md.num_reqs):
        a, b = int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1])
        L = int(md.seq_lens_cpu[i])
        ids = torch.from_numpy(table[i, : -(-L // bs)]).long()
        keys, vals = (kv_quant.gather_dequantized(cache[p], scales[p], ids, torch.float32).reshape(-1, Hkv, D)[:L]
                      .repeat_interleave(H // Hkv, 1).transpose(0, 1) for p in (0, 1))
        qpos = torch.arange(L - (b - a), L)[:, None]
        kpos = torch.arange(L)[None, :]
        visible = kpos <= qpos
        if window:
            visible &= qpos - kpos < window
        s = (q[a:b].float().transpose(0, 1) @ keys.transpose(1, 2) * D**-0.5).masked_fill(~visible, float("-inf"))
        out[a:b] = (torch.softmax(s, -1) @ vals).transpose(0, 1)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_reference_quantizer(name):
    spec = kv_quant.kv_quant(name)
    x = torch.randn(6, 3, 64, generator=torch.Generator().manual_seed(1))
    x = x * torch.tensor([1.0, 3e4, 1e-4, 0.0, 1e30, 7.0])[:, None, None]  # large, tiny and all-zero rows
    values, scales = kv_quant.quantize(x, spec)
    assert values.dtype == spec.dtype and scales.dtype == torch.bfloat16 and scales.shape == (6, 3)
    back = kv_quant.dequantize(values, scales, torch.float32)
    assert torch.isfinite(back).all()
    assert (back[3] == 0).all()
    # error relative to each row's largest magnitude: half a step of the 8-bit grid (plus the
    # bf16 scale's rounding), e4m3 has 3 mantissa bits, e5m2 2
    bound = {"int8": 0.5 / 127 + 4e-3, "fp8_e4m3": 2**-4 + 4e-3, "fp8_e5m2": 2**-3 + 4e-3}[name]
    err = (back - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-38)
    assert float(err[[0, 1, 2, 4, 5]].max()) <= bound


def test_names_and_aliases():
    assert kv_quant.kv_quant("auto") is None
    assert kv_quant.kv_quant("fp8") is kv_quant.kv_quant("fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.kv_quant("int4")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_write_is_byte_identical(kernels, name, dtype):
    spec = kv_quant.kv_quant(name)
    g = torch.Generator().manual_seed(2)
    nb, bs, Hkv, D, T = 8, 4, 2, 48, 11
    k, v = (torch.randn(T, Hkv, D, generator=g) * torch.logspace(-3, 4, T)[:, None, None] for _ in range(2))
    k[3] = 0.0
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[5] = -1  # a padding row: not written
    caches = [torch.zeros(2, nb, bs, Hkv, D, dtype=spec.dtype) for _ in range(2)]
    scales = [torch.zeros(2, nb, bs, Hkv, dtype=torch.bfloat16) for _ in range(2)]
    kernels.write_kv_quant(caches[0][0], caches[0][1], scales[0][0], scales[0][1], k, v, slots)
    for p, x in ((0, k), (1, v)):
        kv_quant.write_quantized(caches[1][p], scales[1][p], x, slots, spec)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert torch.equal(scales[0], scales[1])
    assert int((scales[0] != 0).sum()) == 2 * (T - 1) * Hkv - Hkv  # the zero key row has scale 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("H,Hkv,D,window", [(6, 2, 32, None), (4, 4, 64, 24), (8, 2, 40, None)])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_attention_matches_dense_dequantized_reference(monkeypatch, name, case, H, Hkv, D, window, use_kernel):
    """D 32/64: the AVX-512 tiles; 40: the AVX2 tiles (and the scalar build's loop elsewhere)."""
    if use_kernel and cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: kernel unavailable")
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "ready", lambda: None)
    spec, bs = kv_quant.kv_quant(name), 16
    cache, scales, md, q, k, v, table = make_step(**CASES[case], H=H, Hkv=Hkv, D=D, bs=bs, spec=spec, seed=case)
    impl = torch_native.TorchNativeAttention(H, Hkv, D, D**-0.5, window)
    out = impl.forward(q, k, v, cache, md, kv_scales=scales)
    ref = dense_reference(cache, scales, md, q, table, H, Hkv, D, bs, window)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-4)
    # the step's own rows were written (quantized) before attending
    spec_q, spec_s = kv_quant.quantize(k, spec)
    flat = cache[0].view(torch.uint8).view(-1, Hkv, D)[md.slot_mapping]
    assert torch.equal(flat, spec_q.view(torch.uint8)) and torch.equal(scales[0].view(-1, Hkv)[md.slot_mapping], spec_s)


@pytest.mark.parametrize("name", NAMES)
def test_kernel_bfloat16_query_and_large_activations(kernels, name):
    """A bf16 model over an 8-bit cache, activations of magnitude ~1e4 (fp8 e4m3's range is 448,
    int8's 127: only the scales keep them finite)."""
    spec, H, Hkv, D, bs = kv_quant.kv_quant(name), 6, 2, 64, 16
    cache, scales, md, q, k, v, table = make_step(**CASES[1], H=H, Hkv=Hkv, D=D, bs=bs, spec=spec, seed=5,
                                                  magnitude=1e4)
    q = q * 1e-4  # finite scores; K and V keep their magnitude
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    out = torch_native.TorchNativeAttention(H, Hkv, D, D**-0.5, None).forward(q, k, v, cache, md, kv_scales=scales)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = dense_reference(cache, scales, md, q, table, H, Hkv, D, bs, None)
    torch.testing.assert_close(out.float(), ref, atol=1e4 * 1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("D", [16, 8])
def test_kernel_widens_every_byte_exactly(kernels, name, D):
    """All 256 byte patterns (fp8 NaNs aside) as value rows of one-token sequences with scale 1:
    the decode kernel's output is each row widened, exactly as torch converts it. D 16: the
    AVX-512 tiles; 8: the AVX2 ones."""
    spec = kv_quant.kv_quant(name)
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    B = 256 // D
    v = patterns.view(B, 1, 1, D).view(spec.dtype)  # one block of one token per sequence
    k = torch.zeros_like(v)
    scales = torch.ones(B, 1, 1, dtype=torch.bfloat16)
    out = torch.empty(B, 1, D)
    kernels.paged_decode_attention(out, torch.zeros(B, 1, D), k, v, torch.arange(B, dtype=torch.int32)[:, None],
                                   torch.ones(B, dtype=torch.int32), 1.0, 0, 0.0, k_scales=scales, v_scales=scales)
    expected = v.float().view(B, 1, D)
    finite = torch.isfinite(expected)
    assert int((~finite).sum()) == {"int8": 0, "fp8_e4m3": 2, "fp8_e5m2": 8}[name]  # NaNs (and e5m2 infinities)
    assert torch.equal(out[finite], expected[finite])
