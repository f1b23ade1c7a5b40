"""Batched KV block copies (beam search copy-on-write) against a pair-by-pair reference: the
torch gather + scatter on whole caches, per-layer views (MHA, MLA, 8-bit scales), and the Triton
kernel (compiled on CUDA, else under TRITON_INTERPRET=1 on CPU tensors)."""
import os
import sys

import pytest
import torch

from pagedllm.attention.block_copy import copy_blocks, copy_blocks_reference, layer_cache_planes

PAIRS = [(3, 7), (0, 5), (3, 9), (11, 2)]  # one source copied twice (two children of one parent)


def _cache(shape, dtype):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.int8:
        return torch.randint(-128, 127, shape, generator=g, dtype=torch.int8)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", [(2, 3, 12, 4, 2, 8), (1, 2, 12, 1, 1, 24), (2, 3, 12, 16, 2)])
def test_torch_copy_matches_reference(shape, dtype):
    cache = _cache(shape, dtype)
    ref = cache.clone()
    copy_blocks_reference(ref, PAIRS)
    copy_blocks([cache], PAIRS)
    assert torch.equal(cache, ref)
    untouched = [b for b in range(12) if b not in {d for _, d in PAIRS}]
    assert torch.equal(cache[:, :, untouched], _cache(shape, dtype)[:, :, untouched])


class _Layer:
    def __init__(self, kv_cache, kv_scales=None):
        self.kv_cache, self.kv_scales = kv_cache, kv_scales


def test_layer_views_write_through_to_the_whole_cache():
    whole = _cache((2, 3, 12, 4, 2, 8), torch.float32)
    scales = _cache((2, 3, 12, 4, 2), torch.float32)
    mla = _cache((1, 2, 12, 4, 1, 24), torch.float32)
    ref, ref_scales, ref_mla = whole.clone(), scales.clone(), mla.clone()
    for t in (ref, ref_scales, ref_mla):
        copy_blocks_reference(t, PAIRS)
    layers = [_Layer(whole[:, i], scales[:, i]) for i in range(3)] + [_Layer(mla[0, i]) for i in range(2)]
    copy_blocks(layer_cache_planes(layers), PAIRS)
    assert torch.equal(whole, ref) and torch.equal(scales, ref_scales) and torch.equal(mla, ref_mla)


def _interpreted_triton():
    """The Triton module, compiled on CUDA; under the interpreter otherwise (skip if triton was
    already imported compiled in this process: the interpreter is chosen at decoration)."""
    native = torch.cuda.is_available() and os.environ.get("PAGEDLLM_TRITON_NATIVE") != "0"
    if not native and "triton" in sys.modules and "pagedllm.attention.triton_block_copy" not in sys.modules:
        import triton.language.standard as std

        if type(std.cdiv).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported compiled earlier in this process; run this file on its own")
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0" if native else "1"
    try:
        pytest.importorskip("triton")
        import pagedllm.attention.triton_block_copy as tbc
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev
    if not native and type(tbc._copy_blocks_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton_block_copy was imported compiled earlier in this process")
    return tbc, ("cuda" if native else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("shape,block", [((2, 2, 12, 4, 2, 8), 1024), ((2, 1, 12, 3, 1, 40), 32)])
def test_triton_copy_matches_reference(shape, block, dtype, monkeypatch):
    tbc, device = _interpreted_triton()
    if device == "cpu":  # the interpreter reads it again at launch (triton imports parts lazily)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cache = _cache(shape, dtype).to(device)
    ref = cache.clone()
    copy_blocks_reference(ref, PAIRS)
    src = torch.tensor([p[0] for p in PAIRS], device=device)
    dst = torch.tensor([p[1] for p in PAIRS], device=device)
    tbc.triton_copy_blocks(cache, src, dst, block=block)  # block 32 < 120 elements: several chunks, a masked tail
    assert torch.equal(cache, ref)


def test_triton_copy_on_a_layer_view(monkeypatch):
    """One layer's strided view of a whole cache (what the runner passes), and MLA's view."""
    tbc, device = _interpreted_triton()
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    whole = _cache((2, 3, 12, 4, 2, 8), torch.float32).to(device)
    mla = _cache((1, 3, 12, 4, 1, 24), torch.float32).to(device)
    ref, ref_mla = whole.clone(), mla.clone()
    copy_blocks_reference(ref[:, 1:2], PAIRS)
    copy_blocks_reference(ref_mla[:, 2:3], PAIRS)
    src = torch.tensor([p[0] for p in PAIRS], device=device)
    dst = torch.tensor([p[1] for p in PAIRS], device=device)
    views = layer_cache_planes([_Layer(whole[:, 1]), _Layer(mla[0, 2])])
    assert not views[0].is_contiguous()  # both planes of one layer: strided
    for view in views:
        assert tbc.block_is_contiguous(view)
        tbc.triton_copy_blocks(view, src, dst, block=16)
    assert torch.equal(whole, ref) and torch.equal(mla, ref_mla)
