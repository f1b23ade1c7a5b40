"""Triton paged-attention kernels vs a dense torch reference.

Without CUDA the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors),
so this file runs on CPU-only machines. With CUDA (or ``PAGEDLLM_TRITON_NATIVE=1``) the same tests
run compiled on the GPU, plus the larger CUDA-only tests at the bottom; ``PAGEDLLM_TRITON_NATIVE=0``
forces the interpreter. ``test_compiles_for_sm90_without_gpu`` compiles every kernel variant the
wrappers launch for sm_90 with the real Triton compiler, GPU or not.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from triton_aot import COMPILE_RECORDED_CALLS, aot_compile, check_background_aot  # noqa: F401 (aot_compile: autouse)

import triton_mode
from triton_mode import NATIVE

# Compiled on CUDA machines, Triton's interpreter on CPU (tests/triton_mode.py says why it is set
# before triton is imported).
_ENV = triton_mode.enter()

if not NATIVE and _ENV.triton_imported_before:
    import triton.language.standard as _tl_std

    if type(_tl_std.cdiv).__name__ != "InterpretedFunction":
        _ENV.restore()
        pytest.skip(
            "triton was imported in compiled mode earlier in this process, so the interpreter "
            "can't run here; run this file on its own",
            allow_module_level=True,
        )
if not NATIVE:
    triton_mode.patch_interpreter()
try:
    import pagedllm.attention.triton_attn as _ta
finally:
    _ENV.restore()
triton_mode.skip_unless_interpreted(_ta._unified_attention_kernel, "pagedllm.attention.triton_attn", _ENV)


@pytest.fixture(autouse=True, scope="module")
def _triton_interpret_env():
    """Triton imports some of its own @jit code lazily at first launch (and asserts the mode
    then), so the variable must also hold while this module's tests run; restored afterwards."""
    _ENV.set()
    yield
    _ENV.restore()


from pagedllm.attention.backend import AttentionMetadata  # noqa: E402

TritonAttentionBackend = _ta.TritonAttentionBackend
choose_num_splits = _ta.choose_num_splits
reshape_and_cache = _ta.reshape_and_cache
unified_attention = _ta.unified_attention

DEVICE = torch.device("cuda" if NATIVE else "cpu")
TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
if NATIVE:
    # compiled fp32 dots use IEEE; only reduction order differs
    TOL[torch.float32] = (1e-3, 1e-3)


# ------------------------------------------------------------------------------------------------
# case construction + dense reference
# ------------------------------------------------------------------------------------------------


class Case:
    """A ragged batch: cached prefixes already in a NaN-poisoned cache, new K/V still to store."""

    def __init__(
        self,
        reqs: list[tuple[int, int]],  # (seq_len, query_len) per request
        *,
        block_size: int,
        num_kv_heads: int,
        qpk: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int,
        extra_blocks: int = 3,
        pad_tokens: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.reqs = reqs
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.num_heads = num_kv_heads * qpk
        self.head_dim = head_dim
        self.dtype = dtype
        blocks_per_req = [(s + block_size - 1) // block_size for s, _ in reqs]
        num_blocks = sum(blocks_per_req) + extra_blocks
        pool = list(range(num_blocks))
        rng.shuffle(pool)  # non-contiguous, out-of-order block tables
        max_blocks = max(blocks_per_req) + 1
        # Table padding points at block 0 on purpose: the kernel must never read past seq_len.
        self.block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
        self.kv_cache = torch.full(
            (2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
        )
        flat_k = self.kv_cache[0].view(-1, num_kv_heads, head_dim)
        flat_v = self.kv_cache[1].view(-1, num_kv_heads, head_dim)

        self.full_k, self.full_v = [], []
        q_rows, k_rows, v_rows, slots = [], [], [], []
        for i, (seq_len, q_len) in enumerate(reqs):
            assert 1 <= q_len <= seq_len
            blks = [pool.pop() for _ in range(blocks_per_req[i])]
            self.block_table[i, : len(blks)] = torch.tensor(blks, dtype=torch.int32)
            k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
            v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
            self.full_k.append(k)
            self.full_v.append(v)
            pos = torch.arange(seq_len)
            slot = torch.tensor(blks, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
            ctx = seq_len - q_len
            flat_k[slot[:ctx]] = k[:ctx]
            flat_v[slot[:ctx]] = v[:ctx]
            slots.append(slot[ctx:])
            k_rows.append(k[ctx:])
            v_rows.append(v[ctx:])
            q_rows.append(torch.randn(q_len, self.num_heads, head_dim, generator=g).to(dtype))

        self.num_tokens = sum(q for _, q in reqs)
        self.query = torch.cat(q_rows + [torch.randn(pad_tokens, self.num_heads, head_dim, generator=g).to(dtype)])
        self.key = torch.cat(k_rows + [torch.randn(pad_tokens, num_kv_heads, head_dim, generator=g).to(dtype)])
        self.value = torch.cat(v_rows + [torch.randn(pad_tokens, num_kv_heads, head_dim, generator=g).to(dtype)])
        self.slot_mapping = torch.cat(slots + [torch.full((pad_tokens,), -1, dtype=torch.int64)])
        q_lens = np.array([q for _, q in reqs], dtype=np.int32)
        self.query_start_loc_cpu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        self.seq_lens_cpu = np.array([s for s, _ in reqs], dtype=np.int32)
        self.scale = head_dim**-0.5

    def to(self, device: torch.device) -> "Case":
        for name in ("block_table", "kv_cache", "query", "key", "value", "slot_mapping"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def metadata(self) -> AttentionMetadata:
        dev = self.query.device
        return AttentionMetadata(
            num_actual_tokens=self.num_tokens,
            query_start_loc=torch.from_numpy(self.query_start_loc_cpu).to(dev),
            seq_lens=torch.from_numpy(self.seq_lens_cpu).to(dev),
            block_table=self.block_table.to(dev),
            slot_mapping=self.slot_mapping[: self.num_tokens].to(dev),
            max_query_len=max(q for _, q in self.reqs),
            max_seq_len=max(s for s, _ in self.reqs),
            query_start_loc_cpu=self.query_start_loc_cpu,
            seq_lens_cpu=self.seq_lens_cpu,
        )

    def gather_kv(self, i: int, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's K/V read back from the paged cache through its block table."""
        seq_len = self.reqs[i][0]
        pos = torch.arange(seq_len)
        bt = self.block_table[i].cpu().long()
        slot = bt[pos // self.block_size] * self.block_size + pos % self.block_size
        cache = self.kv_cache.cpu() if cache is None else cache
        k = cache[0].reshape(-1, self.num_kv_heads, self.head_dim)[slot]
        v = cache[1].reshape(-1, self.num_kv_heads, self.head_dim)[slot]
        return k, v

    def reference(self, sliding_window: int | None, soft_cap: float | None = None,
                  alibi: torch.Tensor | None = None) -> torch.Tensor:
        """Dense fp32 attention, K/V gathered from the cache (after the kernel stored them)."""
        qpk = self.num_heads // self.num_kv_heads
        out = torch.zeros(self.num_tokens, self.num_heads, self.head_dim)
        query = self.query.cpu().float()
        cache = self.kv_cache.cpu()
        for i, (seq_len, q_len) in enumerate(self.reqs):
            k, v = self.gather_kv(i, cache)
            k = k.float().repeat_interleave(qpk, dim=1)  # [seq, H, D]
            v = v.float().repeat_interleave(qpk, dim=1)
            start = int(self.query_start_loc_cpu[i])
            q = query[start : start + q_len]  # [q_len, H, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            if soft_cap:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            qpos = torch.arange(seq_len - q_len, seq_len)[:, None]
            kpos = torch.arange(seq_len)[None, :]
            visible = kpos <= qpos
            if sliding_window:
                visible &= (qpos - kpos) < sliding_window
            if alibi is not None:
                scores = scores + alibi[:, None, None] * (kpos - qpos)
            scores = scores.masked_fill(~visible, float("-inf"))
            out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return out


def _random_reqs(rng: random.Random, block_size: int, n: int, max_blocks: int) -> list[tuple[int, int]]:
    """Mix of decodes, chunked prefills with cached prefix, and fresh prefills."""
    reqs = []
    for j in range(n):
        seq_len = rng.randint(1, max_blocks * block_size)
        kind = j % 3
        if kind == 0:
            q_len = 1  # decode
        elif kind == 1:
            q_len = rng.randint(1, seq_len)  # chunk over a cached prefix
        else:
            q_len = seq_len  # fresh prefill
        reqs.append((seq_len, q_len))
    rng.shuffle(reqs)
    return reqs


def _run(case: Case, sliding_window: int | None = None, num_splits: int | None = None,
         soft_cap: float | None = None, alibi: torch.Tensor | None = None) -> torch.Tensor:
    extra = {} if alibi is None else {"alibi_slopes": alibi.to(DEVICE)}
    impl = TritonAttentionBackend.make_impl(
        case.num_heads, case.num_kv_heads, case.head_dim, case.scale, sliding_window, soft_cap, **extra
    )
    impl.num_splits = num_splits
    out = impl.forward(case.query, case.key, case.value, case.kv_cache, case.metadata())
    assert out.shape == case.query.shape and out.dtype == case.dtype
    return out


def _check(case: Case, out: torch.Tensor, sliding_window: int | None = None, soft_cap: float | None = None,
           alibi: torch.Tensor | None = None) -> None:
    n = case.num_tokens
    got = out[:n].float().cpu()
    assert torch.isfinite(got).all()
    # Stored K/V must match what we generated (reshape_and_cache + block table round trip).
    cache = case.kv_cache.cpu()
    for i in range(len(case.reqs)):
        k, v = case.gather_kv(i, cache)
        assert torch.equal(k, case.full_k[i]) and torch.equal(v, case.full_v[i])
    ref = case.reference(sliding_window, soft_cap, alibi)
    atol, rtol = TOL[case.dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------


def test_backend_name():
    assert TritonAttentionBackend.name == "triton"


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache(block_size, dtype):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, kv_heads, head_dim, n = 6, 3, 64, 11  # 3 heads: non-power-of-two padding
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    # Non-contiguous key/value views, as produced by splitting a fused qkv projection.
    qkv = torch.randn(n, 4 * kv_heads, head_dim, generator=g).to(dtype)
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 3 * kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[[2, 7]] = -1  # padding tokens: skipped
    cache, key, value, slots_dev = cache.to(DEVICE), key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE)
    reshape_and_cache(key, value, cache, slots_dev)
    expected = torch.zeros(2, num_blocks * block_size, kv_heads, head_dim, dtype=dtype)
    keep = slots >= 0
    expected[0, slots[keep]] = key.cpu()[keep]
    expected[1, slots[keep]] = value.cpu()[keep]
    assert torch.equal(cache.cpu().view(2, -1, kv_heads, head_dim), expected)


MIXED = [
    # block_size, kv_heads, qpk, head_dim, dtype, seed
    (8, 2, 1, 64, torch.float32, 0),
    (16, 2, 2, 128, torch.float32, 1),
    (32, 1, 4, 64, torch.float32, 2),
    (16, 1, 4, 128, torch.bfloat16, 3),
    (8, 2, 2, 64, torch.bfloat16, 4),
    (32, 2, 1, 128, torch.bfloat16, 5),
    (16, 2, 2, 64, torch.float16, 6),
]


@pytest.mark.parametrize("block_size,kv_heads,qpk,head_dim,dtype,seed", MIXED)
def test_mixed_batch(block_size, kv_heads, qpk, head_dim, dtype, seed):
    rng = random.Random(seed)
    reqs = _random_reqs(rng, block_size, n=5, max_blocks=3)
    case = Case(
        reqs, block_size=block_size, num_kv_heads=kv_heads, qpk=qpk, head_dim=head_dim,
        dtype=dtype, seed=seed,
    ).to(DEVICE)
    _check(case, _run(case))


def test_edge_lengths_and_padding():
    # seq_len == 1 decode, exact block multiples, chunk ending exactly on a block boundary,
    # a chunk longer than one query tile, and padded (CUDA-graph style) rows after the batch.
    reqs = [(1, 1), (16, 16), (32, 1), (33, 17), (48, 16), (70, 70)]
    case = Case(
        reqs, block_size=16, num_kv_heads=1, qpk=2, head_dim=64, dtype=torch.float32, seed=11,
        pad_tokens=3,
    ).to(DEVICE)
    out = _run(case)
    _check(case, out)
    assert torch.all(out[case.num_tokens :] == 0)


def test_non_power_of_two_head_dim_and_group():
    # head_dim 80 (padded to 128), 3 query heads per kv head (padded to 4)
    rng = random.Random(21)
    reqs = _random_reqs(rng, 16, n=4, max_blocks=2)
    case = Case(reqs, block_size=16, num_kv_heads=2, qpk=3, head_dim=80, dtype=torch.float32, seed=21).to(DEVICE)
    _check(case, _run(case))


@pytest.mark.parametrize("window", [1, 7, 20])
def test_sliding_window(window):
    reqs = [(45, 1), (40, 13), (30, 30), (5, 2)]
    case = Case(reqs, block_size=8, num_kv_heads=2, qpk=2, head_dim=64, dtype=torch.float32, seed=window).to(DEVICE)
    _check(case, _run(case, sliding_window=window), sliding_window=window)


@pytest.mark.parametrize("window,num_splits,dtype", [(None, None, torch.float32), (12, None, torch.float32),
                                                  (None, 2, torch.float32), (None, None, torch.bfloat16)])
def test_logit_soft_cap(window, num_splits, dtype):
    """Gemma 2's cap * tanh(score / cap) before the softmax; a small cap so it changes the result."""
    reqs = [(45, 1), (40, 13), (30, 30), (5, 2)] if num_splits is None else [(90, 1), (33, 1)]
    case = Case(reqs, block_size=8, num_kv_heads=2, qpk=2, head_dim=64, dtype=dtype, seed=5)
    case.query = case.query * 4  # scores well past the cap
    case = case.to(DEVICE)
    _check(case, _run(case, sliding_window=window, num_splits=num_splits, soft_cap=2.0), window, soft_cap=2.0)
    assert (case.reference(window, 2.0) - case.reference(window)).abs().max() > 0.1  # (K/V now in the cache)


@pytest.mark.parametrize("kv_heads,qpk,num_splits,dtype", [(1, 4, None, torch.float32), (2, 2, 2, torch.float32),
                                                         (4, 1, None, torch.bfloat16)])
def test_alibi(kv_heads, qpk, num_splits, dtype):
    """ALiBi (Falcon): slope * (key - query position) added to the scaled scores, multi-query and
    grouped heads, decodes (also split-KV) and chunks over a cached prefix."""
    reqs = [(45, 1), (40, 13), (30, 30), (5, 2)] if num_splits is None else [(90, 1), (33, 1)]
    case = Case(reqs, block_size=8, num_kv_heads=kv_heads, qpk=qpk, head_dim=64, dtype=dtype, seed=9).to(DEVICE)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(kv_heads * qpk)])
    _check(case, _run(case, num_splits=num_splits, alibi=slopes), alibi=slopes)
    assert (case.reference(None, None, slopes) - case.reference(None)).abs().max() > 0.1


@pytest.mark.parametrize(
    "reqs,num_splits,window",
    [
        ([(100, 1), (37, 1), (3, 1)], 4, None),  # decode-only, some splits get no KV tiles
        ([(130, 1), (64, 1)], 2, 50),  # splits + sliding window
        ([(90, 1), (60, 20)], 4, None),  # splits are also correct with a prefill chunk
    ],
)
def test_split_kv(reqs, num_splits, window):
    case = Case(reqs, block_size=16, num_kv_heads=2, qpk=4, head_dim=64, dtype=torch.float32, seed=num_splits).to(DEVICE)
    out = _run(case, sliding_window=window, num_splits=num_splits)
    _check(case, out, sliding_window=window)


def test_split_kv_bf16_matches_unsplit():
    reqs = [(150, 1), (77, 1)]
    case = Case(reqs, block_size=32, num_kv_heads=1, qpk=2, head_dim=128, dtype=torch.bfloat16, seed=5).to(DEVICE)
    split = _run(case, num_splits=2)
    _check(case, split)
    unsplit = _run(case, num_splits=1)  # re-stores the same K/V: idempotent
    torch.testing.assert_close(split.float(), unsplit.float(), atol=2e-2, rtol=2e-2)


def test_direct_unified_attention_call():
    # Functional API, without the backend wrapper; out may be a strided view.
    case = Case([(20, 4), (9, 1)], block_size=8, num_kv_heads=2, qpk=2, head_dim=64, dtype=torch.float32, seed=9).to(DEVICE)
    md = case.metadata()
    reshape_and_cache(case.key, case.value, case.kv_cache, md.slot_mapping)
    big = torch.zeros(case.num_tokens, case.num_heads, 2 * case.head_dim, device=DEVICE)
    out = big[:, :, : case.head_dim]
    unified_attention(
        case.query, case.kv_cache, out, md.query_start_loc, md.seq_lens, md.block_table,
        num_tokens=md.num_actual_tokens, num_reqs=md.num_reqs, max_query_len=md.max_query_len,
        max_seq_len=md.max_seq_len, scale=case.scale,
    )
    torch.testing.assert_close(out.cpu(), case.reference(None), atol=2e-4, rtol=2e-4)
    assert torch.all(big[:, :, case.head_dim :] == 0)


def test_choose_num_splits():
    assert choose_num_splits(4, 8, max_query_len=1, max_seq_len=32768, sm_count=132) > 1
    assert choose_num_splits(4, 8, max_query_len=2, max_seq_len=32768, sm_count=132) == 1
    assert choose_num_splits(64, 8, max_query_len=1, max_seq_len=4096, sm_count=132) == 1
    assert choose_num_splits(1, 1, max_query_len=1, max_seq_len=512, sm_count=132) == 1
    s = choose_num_splits(1, 8, max_query_len=1, max_seq_len=4096, sm_count=132)
    assert s & (s - 1) == 0 and 2 <= s <= 4096 // 256


# ------------------------------------------------------------------------------------------------
# GPU-only: bigger shapes (too slow for the interpreter)
# ------------------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not NATIVE, reason="needs CUDA (compiled kernels)")


@cuda_only
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large_mixed(block_size, dtype):
    rng = random.Random(block_size)
    reqs = [(rng.randint(1, 3000), 1) for _ in range(24)]
    reqs += [(2000, 512), (1500, 1500), (777, 300), (4100, 1)]
    rng.shuffle(reqs)
    case = Case(reqs, block_size=block_size, num_kv_heads=8, qpk=4, head_dim=128, dtype=dtype, seed=block_size).to(DEVICE)
    _check(case, _run(case))


@cuda_only
@pytest.mark.parametrize("window", [None, 1024])
def test_gpu_long_decode_split(window):
    reqs = [(16384, 1), (9000, 1)]
    case = Case(reqs, block_size=16, num_kv_heads=8, qpk=4, head_dim=128, dtype=torch.bfloat16, seed=3).to(DEVICE)
    md = case.metadata()
    assert choose_num_splits(md.num_reqs, 8, 1, md.max_seq_len, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    out = _run(case, sliding_window=window)  # heuristic picks split-KV here
    _check(case, out, sliding_window=window)
    torch.testing.assert_close(out.float(), _run(case, sliding_window=window, num_splits=1).float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------
# Real-compiler check without a GPU: compile every launch the Python wrappers make (same args,
# same constexprs, Triton-style specialisation of ==1 / %16 ints) for sm_90 down to a cubin.
# Catches typing/lowering errors the interpreter tolerates. Runs in a subprocess because this
# module's kernels are interpreted.
# ------------------------------------------------------------------------------------------------

_AOT_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
import numpy as np
from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention import triton_attn as ta

TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}
calls = []

class Recorder:
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        return lambda *a, **kw: calls.append((self.fn, a, kw))

for name in ("_unified_attention_kernel", "_reduce_splits_kernel", "_reshape_and_cache_kernel"):
    setattr(ta, name, Recorder(getattr(ta, name)))

def launch(reqs, dtype, qpk, head_dim, block_size, window=None, splits=None, kv_heads=2, soft_cap=None, alibi=False):
    # Shapes/dtypes exactly as the engine passes them; contents don't matter (nothing runs).
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
    cache = torch.zeros(2, nblk, block_size, kv_heads, head_dim, dtype=dtype)
    extra = {"alibi_slopes": torch.ones(h)} if alibi else {}
    impl = ta.TritonAttentionBackend.make_impl(h, kv_heads, head_dim, head_dim ** -0.5, window, soft_cap, **extra)
    impl.num_splits = splits
    impl.forward(qkv[:, :h], qkv[:, h:h + kv_heads], qkv[:, h + kv_heads:], cache, md)

launch([(40, 1), (30, 1)], torch.bfloat16, 4, 128, 16)                    # decode
launch([(300, 1), (90, 1)], torch.bfloat16, 4, 128, 16, window=64, splits=4)  # split-KV + window
launch([(64, 64), (40, 13), (9, 1)], torch.float32, 1, 64, 32)            # prefill, fp32 ieee dots
launch([(50, 20), (7, 1)], torch.float16, 3, 80, 8)                       # odd group/head dim
launch([(33, 1)], torch.bfloat16, 1, 64, 16, kv_heads=1)                   # num_reqs == 1, num_heads == 1 (int specialisation)
launch([(64, 64), (40, 1)], torch.bfloat16, 2, 256, 16, window=32, soft_cap=50.0)  # Gemma 2: soft-cap + window
launch([(64, 64), (40, 1)], torch.bfloat16, 8, 64, 16, kv_heads=1, alibi=True)  # Falcon-7B style: ALiBi, multi-query

""" + COMPILE_RECORDED_CALLS


def test_compiles_for_sm90_without_gpu(aot_compile):  # started with the module's first test (triton_aot.py)
    check_background_aot(aot_compile)


def test_decode_graph_runner_padded_static_buffers_match_eager(tmp_path):
    """The CUDA-graph decode path (static buffers padded to a captured size, max_seq_len fixed at
    the longest context so split-KV has empty splits) gives the eager flat forward's hidden
    states, and its padding rows write nothing into the KV cache. On CPU the padded forward runs
    eagerly through the interpreter; on CUDA the graphs are really captured and replayed."""
    from checkpoints import make_checkpoint

    from pagedllm.attention.backend import AttentionMetadata
    from pagedllm.attention.triton_attn import TritonAttentionBackend
    from pagedllm.config import EngineConfig
    from pagedllm.models.config_json import load_hf_config
    from pagedllm.attention.forward_context import set_attention_metadata
    from pagedllm.worker.cuda_graphs import DecodeGraphRunner, capture_sizes
    from pagedllm.worker.worker import Worker

    assert capture_sizes(3) == [1, 2, 3] and capture_sizes(100)[-2:] == [96, 100] and capture_sizes(4096)[-1] == 512
    path = make_checkpoint(str(tmp_path / "m"), "llama")
    cfg = EngineConfig(model=path, dtype="float32", device=DEVICE.type, block_size=16, enforce_eager=True)
    worker = Worker(cfg, load_hf_config(path), 1024, 1024)
    worker.initialize_cache(72)
    for i, layer in enumerate(worker.model.attention_layers()):
        layer.bind(TritonAttentionBackend, worker.kv_cache[:, i])
    model, bs = worker.model, 16
    rng = np.random.default_rng(0)
    lens = np.array([5, 17, 9])
    table = np.array([[0, 1], [2, 3], [4, 5]], dtype=np.int32)

    def forward(ids, qsl, seq_lens, positions):
        req = np.repeat(np.arange(3), np.diff(qsl))
        slots = table[req, positions // bs].astype(np.int64) * bs + positions % bs
        md = AttentionMetadata.from_host(qsl, seq_lens, table, slots, DEVICE)
        with torch.inference_mode(), set_attention_metadata(md):
            return model(torch.tensor(ids, device=DEVICE), torch.from_numpy(positions).to(DEVICE)), md

    prompt = rng.integers(3, 500, int(lens.sum()))
    forward(prompt, np.concatenate([[0], np.cumsum(lens)]), lens, np.concatenate([np.arange(n) for n in lens]))
    new_ids = rng.integers(3, 500, 3)
    eager, md = forward(new_ids, np.arange(4), lens + 1, lens.copy())
    cache_after_eager = worker.kv_cache.clone()

    graphs = DecodeGraphRunner(model, 8, 1024 // bs, 1024, DEVICE, capture=NATIVE)
    assert graphs.padded_size(3) == 4 and graphs.padded_size(9) is None
    graphs.capture()
    with torch.inference_mode():
        out = graphs.run(torch.tensor(new_ids, device=DEVICE), torch.from_numpy(lens).to(DEVICE), md.slot_mapping,
                         md.seq_lens, md.block_table)
    torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)
    # Padding rows (slot -1) wrote nothing; the real rows rewrote their own slots.
    flat_now = worker.kv_cache.view(2, worker.kv_cache.shape[1], -1, worker.kv_cache.shape[-2], worker.kv_cache.shape[-1])
    flat_eager = cache_after_eager.view_as(flat_now)
    written = md.slot_mapping.cpu()
    untouched = torch.ones(flat_now.shape[2], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat_now[:, :, untouched.to(DEVICE)], flat_eager[:, :, untouched.to(DEVICE)])
    torch.testing.assert_close(flat_now[:, :, md.slot_mapping], flat_eager[:, :, md.slot_mapping], atol=1e-4, rtol=1e-4)
