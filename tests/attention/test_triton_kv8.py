"""8-bit KV cache (kv_cache_dtype int8 / fp8_e4m3 / fp8_e5m2) on the Triton backend.

- The Triton cache write equals kv_quant's reference bit for bit (values and bf16 scales; padding
  slots untouched), on random rows of very different magnitudes and on crafted rows that hit
  every fp8 rounding tie, the subnormals and int8's halves.
- The unified attention kernel over the 8-bit cache equals the torch_native backend over the same
  cache (the reference: it dequantizes the gathered blocks) within float tolerance: decodes, a
  fresh prefill, chunks on a cached prefix mixed in one batch, split-KV, sliding window, soft cap.
- The model's forward with the Triton backend on an 8-bit cache equals the torch_native one, and
  the padded decode path of the CUDA-graph runner (scales bound as device tensors) equals eager.
- The whole engine on the Triton backend (forced on CPU): greedy tokens and logprobs equal
  torch_native's over the same 8-bit cache; preemption and recomputation exact.
- Every new kernel variant compiles for sm_90 with the real Triton compiler (no GPU needed).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), as in
test_triton_attn.py; with CUDA, compiled. The references always run on CPU tensors (torch's CUDA
division by a scalar multiplies by the reciprocal, so the reference scales could differ there).
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
from triton_aot import COMPILE_RECORDED_CALLS, aot_compile, check_background_aot  # noqa: F401 (aot_compile: autouse)

import triton_mode
from triton_mode import NATIVE

_ENV = triton_mode.enter()
if not NATIVE:
    triton_mode.patch_interpreter()
try:
    from pagedllm.attention import triton_attn, triton_kv_quant
finally:
    _ENV.restore()
triton_mode.skip_unless_interpreted(triton_attn._unified_attention_kernel, "triton_attn", _ENV)

from pagedllm.attention import kv_quant
from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.torch_native import TorchNativeAttentionBackend
from pagedllm.kernels import cpu as cpu_kernels

DEVICE = torch.device("cuda" if NATIVE else "cpu")
NAMES = ("int8", "fp8_e4m3", "fp8_e5m2")
# |triton - torch_native| over the same 8-bit cache: fp32 differs only in where the scale is
# applied (score columns vs dequantized keys); half types by the reference's own roundings
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@pytest.fixture(autouse=True, scope="module")
def _interpret_env():
    _ENV.set()
    yield
    _ENV.restore()


@pytest.fixture(autouse=True)
def _torch_paths(monkeypatch):
    """The torch_native reference on its pure-torch paths (dequantize the gathered blocks, then
    SDPA), whether or not another test loaded the C++ kernels in this process."""
    monkeypatch.setattr(cpu_kernels, "ready", lambda: None)


def _empty_cache(shape, spec):
    """An 8-bit cache and scales full of a sentinel (0x5A bytes), to see what a write touched."""
    cache = torch.full(shape, 0x5A, dtype=torch.uint8).view(spec.dtype)
    scales = torch.full(shape[:-1], 0x5A5A, dtype=torch.int16).view(kv_quant.SCALE_DTYPE)
    return cache, scales


def _reference_write(cache, scales, key, value, slots, spec):
    cache, scales = cache.cpu().clone(), scales.cpu().clone()
    for p, x in enumerate((key, value)):
        kv_quant.write_quantized(cache[p], scales[p], x.cpu(), slots.cpu(), spec)
    return cache, scales


def _assert_same_bytes(cache, scales, ref_cache, ref_scales):
    a, b = cache.cpu().view(torch.uint8), ref_cache.view(torch.uint8)
    assert torch.equal(a, b), f"{int((a != b).sum())} cache bytes differ"
    a, b = scales.cpu().view(torch.int16), ref_scales.view(torch.int16)
    assert torch.equal(a, b), f"{int((a != b).sum())} scales differ"


# ------------------------------------------------------------------------------------------------
# the write
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_write_matches_reference_bit_exact(name, dtype):
    spec = kv_quant.kv_quant(name)
    g = torch.Generator().manual_seed(len(name))
    nb, bs, hkv, d, n = 5, 8, 3, 40, 17  # 3 heads, head dim 40: both padded in the kernel
    lo, hi = (-8, 3) if dtype == torch.float16 else (-30, 20)
    magnitude = torch.logspace(lo, hi, n)[:, None, None]  # every row its own scale, tiny to huge
    qkv = (torch.randn(n, 4 * hkv, d, generator=g) * magnitude).to(dtype)
    key, value = qkv[:, hkv : 2 * hkv], qkv[:, 3 * hkv :]  # strided views, as from a fused projection
    key[3] = 0  # all-zero rows: scale 0
    value[4, 1] = 0
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[[2, 9]] = -1  # padding: nothing written
    cache, scales = _empty_cache((2, nb, bs, hkv, d), spec)
    ref_cache, ref_scales = _reference_write(cache, scales, key, value, slots, spec)
    cache, scales = cache.to(DEVICE), scales.to(DEVICE)
    triton_kv_quant.reshape_and_cache_quant(key.to(DEVICE), value.to(DEVICE), cache, scales, slots.to(DEVICE))
    _assert_same_bytes(cache, scales, ref_cache, ref_scales)
    assert (ref_cache.view(torch.uint8) == 0x5A).any()  # the sentinel survives where nothing was written


def _fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite non-negative value of an fp8 format, ascending."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    vals = vals[torch.isfinite(vals) & (vals >= 0)]
    return torch.unique(vals)


def _edge_values(spec) -> torch.Tensor:
    """Values to round: the grid points, the midpoints between neighbours (ties: to even), one
    float32 ulp either side of each midpoint, all with both signs."""
    if spec.dtype == torch.int8:
        grid = torch.arange(0, 128, dtype=torch.float32)
    else:
        grid = _fp8_grid(spec.dtype)
    mids = (grid[1:] + grid[:-1]) / 2
    inf = torch.tensor(float("inf"))
    vals = torch.cat([grid, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf)])
    return torch.cat([vals, -vals])


@pytest.mark.parametrize("name", NAMES)
def test_write_rounding_ties_and_subnormals(name):
    """Rows whose scale is a power of two (each row holds qmax / 8), so the values to round are
    exactly ``8 * x``: every tie, subnormal and signed zero of the format goes through the kernel."""
    spec = kv_quant.kv_quant(name)
    d = 32
    vals = _edge_values(spec)
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % (d - 1))])
    rows = vals.view(-1, d - 1)
    x = torch.cat([torch.full((rows.shape[0], 1), spec.qmax), rows], 1) / 8  # exact: powers of two
    n = x.shape[0]
    key = x.view(n, 1, d)
    value = (-x).view(n, 1, d)
    bs = 16
    nb = -(-n // bs)
    slots = torch.arange(n)
    cache, scales = _empty_cache((2, nb, bs, 1, d), spec)
    ref_cache, ref_scales = _reference_write(cache, scales, key, value, slots, spec)
    assert torch.all(ref_scales.view(2, -1)[:, :n].float() == 1 / 8)
    if spec.dtype != torch.int8:  # the reference really is the format's own rounding
        assert torch.equal(ref_cache[0].reshape(-1, d)[:n].view(torch.uint8),
                           (key.view(n, d) * 8).to(spec.dtype).view(torch.uint8))
    cache, scales = cache.to(DEVICE), scales.to(DEVICE)
    triton_kv_quant.reshape_and_cache_quant(key.to(DEVICE), value.to(DEVICE), cache, scales, slots.to(DEVICE))
    _assert_same_bytes(cache, scales, ref_cache, ref_scales)


# ------------------------------------------------------------------------------------------------
# attention over the 8-bit cache vs torch_native
# ------------------------------------------------------------------------------------------------


class Step:
    """A ragged batch over an 8-bit cache: every cached prefix already quantized into its blocks
    (reference write), this step's new K/V still to write; shuffled, non-contiguous blocks."""

    def __init__(self, reqs, *, block_size, num_kv_heads, qpk, head_dim, dtype, spec, seed, magnitude=1.0):
        g = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.reqs, self.spec, self.dtype = reqs, spec, dtype
        self.num_kv_heads, self.num_heads, self.head_dim = num_kv_heads, num_kv_heads * qpk, head_dim
        qlens = np.array([q for _, q in reqs])
        seqlens = np.array([s for s, _ in reqs])
        maxb = -(-int(seqlens.max()) // block_size)
        nb = len(reqs) * maxb + 2
        table = rng.permutation(nb)[: len(reqs) * maxb].reshape(len(reqs), maxb).astype(np.int32)
        self.qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
        self.seqlens = seqlens.astype(np.int32)
        self.table = table
        pos = np.concatenate([np.arange(s - q, s) for s, q in reqs])
        req = np.repeat(np.arange(len(reqs)), qlens)
        self.slots = torch.from_numpy(table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        self.cache, self.scales = _empty_cache((2, nb, block_size, num_kv_heads, head_dim), spec)
        every = torch.arange(nb * block_size)
        for p in range(2):  # every slot holds quantized values (the prefixes; the rest is never read)
            x = torch.randn(nb * block_size, num_kv_heads, head_dim, generator=g) * magnitude
            kv_quant.write_quantized(self.cache[p], self.scales[p], x.to(dtype), every, spec)
        t = int(qlens.sum())
        self.query = (torch.randn(t, self.num_heads, head_dim, generator=g) * magnitude).to(dtype)
        self.key = (torch.randn(t, num_kv_heads, head_dim, generator=g) * magnitude).to(dtype)
        self.value = (torch.randn(t, num_kv_heads, head_dim, generator=g) * magnitude).to(dtype)
        self.scale = head_dim**-0.5 / magnitude**2  # scores O(1) at any magnitude

    def metadata(self, device) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=int(self.qsl[-1]),
            query_start_loc=torch.from_numpy(self.qsl).to(device),
            seq_lens=torch.from_numpy(self.seqlens).to(device),
            block_table=torch.from_numpy(self.table).to(device),
            slot_mapping=self.slots.to(device),
            max_query_len=int(np.diff(self.qsl).max()),
            max_seq_len=int(self.seqlens.max()),
            query_start_loc_cpu=self.qsl,
            seq_lens_cpu=self.seqlens,
        )

    def run(self, backend, device, *, window=None, soft_cap=None, num_splits=None):
        """(output, cache, scales) after one forward of ``backend`` on a copy of the cache."""
        impl = backend.make_impl(self.num_heads, self.num_kv_heads, self.head_dim, self.scale, window, soft_cap)
        if num_splits is not None:
            impl.num_splits = num_splits
        cache, scales = self.cache.clone().to(device), self.scales.clone().to(device)
        out = impl.forward(self.query.to(device), self.key.to(device), self.value.to(device), cache,
                           self.metadata(device), kv_scales=scales)
        return out.cpu(), cache.cpu(), scales.cpu()


def _compare(step: Step, **kw) -> torch.Tensor:
    out, cache, scales = step.run(triton_attn.TritonAttentionBackend, DEVICE, **kw)
    ref, ref_cache, ref_scales = step.run(TorchNativeAttentionBackend, torch.device("cpu"), **kw)
    _assert_same_bytes(cache, scales, ref_cache, ref_scales)  # the step's write, as well
    assert out.dtype == step.dtype and torch.isfinite(out.float()).all()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[step.dtype] * max(1.0, ref.float().abs().max().item()), err
    return out


MIXED = [(40, 1), (33, 13), (20, 20), (70, 1), (9, 2)]  # decodes, chunks on a prefix, a fresh prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_mixed_batch_matches_torch_native(name, dtype):
    spec = kv_quant.kv_quant(name)
    step = Step(MIXED, block_size=8, num_kv_heads=2, qpk=2, head_dim=64, dtype=dtype, spec=spec, seed=1)
    _compare(step)


@pytest.mark.parametrize("name", NAMES)
def test_decode_only_and_prefill_only(name):
    spec = kv_quant.kv_quant(name)
    decodes = Step([(1, 1), (16, 1), (47, 1)], block_size=16, num_kv_heads=1, qpk=4, head_dim=128,
                   dtype=torch.float32, spec=spec, seed=2)
    _compare(decodes)
    prefill = Step([(37, 37), (5, 5)], block_size=16, num_kv_heads=2, qpk=3, head_dim=80,  # padded group / dim
                   dtype=torch.float32, spec=spec, seed=3)
    _compare(prefill)


@pytest.mark.parametrize("name", NAMES)
def test_split_kv_matches_torch_native_and_unsplit(name):
    spec = kv_quant.kv_quant(name)
    step = Step([(100, 1), (37, 1), (3, 1)], block_size=16, num_kv_heads=2, qpk=2, head_dim=64,
                dtype=torch.float32, spec=spec, seed=4)
    split = _compare(step, num_splits=4)
    unsplit, _, _ = step.run(triton_attn.TritonAttentionBackend, DEVICE, num_splits=1)
    torch.testing.assert_close(split, unsplit, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_sliding_window_and_soft_cap(name):
    spec = kv_quant.kv_quant(name)
    step = Step([(45, 1), (40, 13), (30, 30)], block_size=8, num_kv_heads=2, qpk=2, head_dim=64,
                dtype=torch.float32, spec=spec, seed=5)
    _compare(step, window=7)
    step.query = step.query * 4  # scores well past the cap
    _compare(step, soft_cap=2.0)
    _compare(step, window=12, soft_cap=2.0, num_splits=2)


def test_large_magnitudes():
    """Activations of magnitude ~1000 (beyond fp8's range without a scale): still close."""
    for name in NAMES:
        step = Step(MIXED[:3], block_size=8, num_kv_heads=1, qpk=2, head_dim=64, dtype=torch.float32,
                    spec=kv_quant.kv_quant(name), seed=6, magnitude=1000.0)
        _compare(step)


cuda_only = pytest.mark.skipif(not NATIVE, reason="needs CUDA (compiled kernels; too slow for the interpreter)")


@cuda_only
@pytest.mark.parametrize("name", NAMES)
def test_gpu_large_mixed_and_long_split(name):
    """Real shapes (8 kv heads x 4, head dim 128, bf16): a big mixed batch, and two long decodes for
    which the heuristic picks split-KV."""
    spec = kv_quant.kv_quant(name)
    rng = np.random.default_rng(7)
    reqs = [(int(rng.integers(1, 3000)), 1) for _ in range(24)] + [(2000, 512), (1500, 1500), (777, 300)]
    kw = {"block_size": 16, "num_kv_heads": 8, "qpk": 4, "head_dim": 128, "dtype": torch.bfloat16, "spec": spec}
    _compare(Step(reqs, seed=7, **kw))
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    assert triton_attn.choose_num_splits(2, 8, 1, 16384, sm) > 1
    _compare(Step([(16384, 1), (9000, 1)], seed=8, **kw))


# ------------------------------------------------------------------------------------------------
# the model: Triton backend vs torch_native, and the CUDA-graph decode runner
# ------------------------------------------------------------------------------------------------


def test_model_forward_and_graph_runner(tmp_path):
    """A tiny Llama over an int8 cache: the Triton backend's prefill and decode hidden states equal
    torch_native's (the caches stay byte-identical), and the padded static-buffer decode of
    DecodeGraphRunner (captured and replayed on CUDA) equals the eager one, padding rows writing
    neither values nor scales."""
    from checkpoints import make_checkpoint

    from pagedllm.attention.forward_context import set_attention_metadata
    from pagedllm.config import EngineConfig
    from pagedllm.models.config_json import load_hf_config
    from pagedllm.worker.cuda_graphs import DecodeGraphRunner
    from pagedllm.worker.worker import Worker

    path = make_checkpoint(str(tmp_path / "m"), "llama")
    cfg = EngineConfig(model=path, dtype="float32", device=DEVICE.type, block_size=16, enforce_eager=True,
                       kv_cache_dtype="int8", cpu_kernels=False)
    worker = Worker(cfg, load_hf_config(path), 1024, 1024)
    worker.initialize_cache(72)
    model, bs = worker.model, 16
    layers = model.attention_layers()
    lens = np.array([5, 17, 9])
    table = np.array([[0, 1], [2, 3], [4, 5]], dtype=np.int32)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, int(lens.sum()))
    new_ids = rng.integers(3, 500, 3)

    def forward(ids, qsl, seq_lens, positions):
        req = np.repeat(np.arange(3), np.diff(qsl))
        slots = table[req, positions // bs].astype(np.int64) * bs + positions % bs
        md = AttentionMetadata.from_host(qsl, seq_lens, table, slots, DEVICE)
        with torch.inference_mode(), set_attention_metadata(md):
            return model(torch.tensor(ids, device=DEVICE), torch.from_numpy(positions).to(DEVICE)).cpu(), md

    def steps(backend):
        for i, layer in enumerate(layers):
            layer.bind(backend, worker.kv_cache[:, i], worker.kv_scales[:, i])
        worker.kv_cache.zero_()
        worker.kv_scales.zero_()
        pre, _ = forward(prompt, np.concatenate([[0], np.cumsum(lens)]), lens,
                         np.concatenate([np.arange(n) for n in lens]))
        dec, md = forward(new_ids, np.arange(4), lens + 1, lens.copy())
        return pre, dec, md, worker.kv_cache.cpu().clone(), worker.kv_scales.cpu().clone()

    ref = steps(TorchNativeAttentionBackend) if DEVICE.type == "cpu" else None
    pre, dec, md, cache, scales = steps(triton_attn.TritonAttentionBackend)
    if ref is not None:
        torch.testing.assert_close(pre, ref[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dec, ref[1], atol=1e-4, rtol=1e-4)
        _assert_same_bytes(cache, scales, ref[3], ref[4])

    graphs = DecodeGraphRunner(model, 8, 1024 // bs, 1024, DEVICE, capture=NATIVE)
    graphs.capture()
    with torch.inference_mode():
        out = graphs.run(torch.tensor(new_ids, device=DEVICE), torch.from_numpy(lens).to(DEVICE), md.slot_mapping,
                         md.seq_lens, md.block_table)
    torch.testing.assert_close(out.cpu(), dec, atol=1e-4, rtol=1e-4)
    # padding rows (slot -1) wrote neither values nor scales; the real rows rewrote their own
    # slots with the same K/V up to float rounding (at most one quantization step apart)
    flat = lambda t: t.cpu().reshape(2, t.shape[1], -1, *t.shape[4:])
    now_c, now_s, old_c, old_s = flat(worker.kv_cache), flat(worker.kv_scales), flat(cache), flat(scales)
    written = md.slot_mapping.cpu()
    untouched = torch.ones(now_c.shape[2], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(now_c[:, :, untouched].view(torch.uint8), old_c[:, :, untouched].view(torch.uint8))
    assert torch.equal(now_s[:, :, untouched], old_s[:, :, untouched])
    deq = lambda c, s: kv_quant.dequantize(c[:, :, written], s[:, :, written], torch.float32)
    step = old_s[:, :, written].float().unsqueeze(-1) * 1.01 + 1e-6
    assert ((deq(now_c, now_s) - deq(old_c, old_s)).abs() <= step).all()


def _engine_outputs(monkeypatch, backend, path, prompts, params, **kw):
    """LLM(...).generate with the worker's attention backend forced (the Triton one runs on CPU
    tensors under the interpreter here)."""
    from pagedllm import LLM
    from pagedllm.worker import worker as worker_module

    monkeypatch.setattr(worker_module, "get_attention_backend", lambda device: backend)
    llm = LLM(model=path, dtype="float32", cpu_kernels=False, **kw)
    assert llm.engine.core.executor.worker.backend is backend
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return outs, llm.get_stats()


@pytest.mark.skipif(NATIVE, reason="on CUDA tests/engine/test_kv_cache_dtype.py runs the engine on Triton")
@pytest.mark.parametrize("name", ["int8", "fp8_e5m2"])
def test_engine_on_triton_matches_torch_native(monkeypatch, llama_ckpt, name):
    """The whole engine (worker binding, profiling, scheduler) with the Triton backend on an 8-bit
    cache: the same greedy tokens and logprobs as torch_native's 8-bit cache."""
    from prompts import random_prompts

    from pagedllm import SamplingParams

    prompts = random_prompts((20, 33, 7), seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    kw = {"kv_cache_dtype": name, "kv_cache_memory": 4 << 20}
    ref, _ = _engine_outputs(monkeypatch, TorchNativeAttentionBackend, llama_ckpt, prompts, params, **kw)
    got, _ = _engine_outputs(monkeypatch, triton_attn.TritonAttentionBackend, llama_ckpt, prompts, params, **kw)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(la[t].logprob - lb[t].logprob) for t in la) < 1e-4


@pytest.mark.skipif(NATIVE, reason="on CUDA tests/engine/test_kv_cache_dtype.py runs the engine on Triton")
def test_engine_on_triton_preemption_exact(monkeypatch, llama_ckpt):
    """Eight blocks of 16 for four sequences of 20 + 16 tokens: preempted and recomputed on the
    Triton backend's int8 cache, the tokens equal an ample cache's."""
    from prompts import random_prompts

    from pagedllm import SamplingParams
    from pagedllm.worker.worker import KVCacheSpec

    prompts = random_prompts((20,) * 4, seed=11)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # 36 tokens: a third block each
    backend = triton_attn.TritonAttentionBackend
    kw = {"kv_cache_dtype": "int8", "enable_prefix_caching": False}
    ample, _ = _engine_outputs(monkeypatch, backend, llama_ckpt, prompts, params, kv_cache_memory=4 << 20, **kw)
    tight_bytes = KVCacheSpec(2, 2, 16, 16, torch.float32, quant=kv_quant.kv_quant("int8")).bytes_per_block * 8
    tight, stats = _engine_outputs(monkeypatch, backend, llama_ckpt, prompts, params, kv_cache_memory=tight_bytes,
                                   max_model_len=64, **kw)
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in ample]


# ------------------------------------------------------------------------------------------------
# block copy (copy-on-write) of an fp8 cache and its scales through the Triton kernel
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_triton_block_copy_fp8_cache_and_scales(dtype):
    from pagedllm.attention.block_copy import copy_blocks_reference
    from pagedllm.attention.triton_block_copy import triton_copy_blocks

    pairs = [(3, 7), (0, 5), (3, 9)]
    shape = (2, 3, 12, 4, 2, 8) if dtype != torch.bfloat16 else (2, 3, 12, 4, 4)  # cache / scales (bytes)
    cache = torch.randint(0, 256, shape, dtype=torch.uint8).view(dtype)  # any bytes, NaN patterns included
    ref = cache.clone()
    copy_blocks_reference(ref, pairs)
    cache = cache.to(DEVICE)
    triton_copy_blocks(cache, torch.tensor([p[0] for p in pairs], device=DEVICE),
                       torch.tensor([p[1] for p in pairs], device=DEVICE))
    assert torch.equal(cache.cpu().view(torch.uint8), ref.view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# sm_90 compilation of every 8-bit variant, without a GPU (see test_triton_attn.py)
# ------------------------------------------------------------------------------------------------

_AOT_SCRIPT = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"
import numpy as np
import torch, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from pagedllm.attention import kv_quant, triton_attn as ta, triton_kv_quant as tq, triton_block_copy as tb
from pagedllm.attention.backend import AttentionMetadata

TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
      torch.uint8: "u8", torch.int16: "i16", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv",
      torch.float8_e5m2: "fp8e5"}
calls = []

class Recorder:
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        return lambda *a, **kw: calls.append((self.fn, a, kw))

for mod, name in ((ta, "_unified_attention_kernel"), (ta, "_reduce_splits_kernel"),
                  (tq, "_reshape_and_cache_quant_kernel"), (tb, "_copy_blocks_kernel")):
    setattr(mod, name, Recorder(getattr(mod, name)))

def launch(reqs, dtype, kvd, qpk, head_dim, block_size, window=None, splits=None, kv_heads=2, soft_cap=None):
    spec = kv_quant.kv_quant(kvd)
    seq = np.array([s for s, _ in reqs], dtype=np.int32)
    ql = np.array([q for _, q in reqs], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(ql)]).astype(np.int32)
    n = int(ql.sum())
    nblk = int(sum((s + block_size - 1) // block_size for s in seq))
    md = AttentionMetadata(
        num_actual_tokens=n, query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq),
        block_table=torch.zeros(len(reqs), nblk, dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64), max_query_len=int(ql.max()),
        max_seq_len=int(seq.max()), query_start_loc_cpu=qsl, seq_lens_cpu=seq,
    )
    h = kv_heads * qpk
    qkv = torch.zeros(n, h + 2 * kv_heads, head_dim, dtype=dtype)
    # one layer's views of the whole cache, as the worker binds them
    cache = torch.zeros(2, 3, nblk, block_size, kv_heads, head_dim, dtype=spec.dtype)[:, 1]
    scales = torch.zeros(2, 3, nblk, block_size, kv_heads, dtype=kv_quant.SCALE_DTYPE)[:, 1]
    impl = ta.TritonAttentionBackend.make_impl(h, kv_heads, head_dim, head_dim ** -0.5, window, soft_cap)
    impl.num_splits = splits
    impl.forward(qkv[:, :h], qkv[:, h:h + kv_heads], qkv[:, h + kv_heads:], cache, md, kv_scales=scales)

for kvd in ("int8", "fp8_e4m3", "fp8_e5m2"):
    launch([(40, 1), (30, 1)], torch.bfloat16, kvd, 4, 128, 16)                       # decode
    launch([(300, 1), (90, 1)], torch.bfloat16, kvd, 4, 128, 16, window=64, splits=4)  # split-KV + window
    launch([(64, 64), (40, 13), (9, 1)], torch.float32, kvd, 1, 64, 32)                # prefill, fp32
    launch([(50, 20), (7, 1)], torch.float16, kvd, 3, 80, 8)                           # odd group / head dim
    launch([(64, 64), (40, 1)], torch.bfloat16, kvd, 2, 256, 16, window=32, soft_cap=50.0)
for dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16):
    c = torch.zeros(2, 3, 12, 16, 2, 64, dtype=dt) if dt != torch.bfloat16 else torch.zeros(2, 3, 12, 16, 2, dtype=dt)
    tb.triton_copy_blocks(c, torch.tensor([1]), torch.tensor([2]))

""" + COMPILE_RECORDED_CALLS


def test_compiles_for_sm90_without_gpu(aot_compile):  # started with the module's first test (triton_aot.py)
    check_background_aot(aot_compile)
