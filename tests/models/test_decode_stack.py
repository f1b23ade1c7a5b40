"""The native decode step (models/decode_stack.py, kernels/csrc/decode_stack.cpp): a decode-only
step runs the embedding lookup and every layer in one C++ call, and the LM head in another, and
gives the Python layers' results bit for bit -- the same greedy tokens and the same logprobs -- for
the weight forms it multiplies: pagedllm's packed float panels (float32 and bf16 checkpoints), GGUF
blocks rewritten into quantized panels (Q4_0, Q4_K) and GGUF blocks multiplied as they are (Q5_K,
in a Q4_K_M-style mix with several segments per layer); embedding tables dense, as int8 / int4
panels with and without zero points (Q8_0, Q4_1, Q4_0) or as GGUF blocks (Q5_K), tied to the head or
not; batches of several requests, block sizes 1 and 16. Models it cannot run exactly (biases,
q/k norms) stay in Python and still answer."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf_files import write_gguf  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402

MIX = {f"blk.{i}.{t}.weight": "Q5_K" for i in range(2) for t in ("attn_v", "ffn_down")}


def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(3, 300, size=n).tolist() for n in (5, 17, 40)]


def run(path, native: bool, monkeypatch, **kw):
    kw.setdefault("kv_cache_memory", 8 << 20)
    llm = LLM(model=path, native_decode=native, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=sp, use_tqdm=False)
    inner = llm.engine.core.executor.worker.model.model
    state = inner.__dict__.get("_decode_stack", False)
    return outs, state


def assert_all_native(state):
    """The stack ran, looked the tokens up itself and multiplied the LM head."""
    assert state not in (None, False), "the native decode step did not run"
    assert state.stack.has_embedding, "the embedding was looked up in Python"
    assert state.head is True and state.stack.has_head, "the LM head ran in Python"


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for la, lb in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert {t: v.logprob for t, v in la.items()} == {t: v.logprob for t, v in lb.items()}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_native")


@pytest.mark.parametrize("weight_type,types", [("Q4_0", None), ("Q4_K", MIX)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_gguf_native_equals_python(gguf_dir, monkeypatch, weight_type, types, block_size):
    path = write_gguf(str(gguf_dir / f"{weight_type}-{bool(types)}.gguf"), weight_type, types=types)
    native, state = run(path, True, monkeypatch, dtype="float32", block_size=block_size)
    assert_all_native(state)
    python, off = run(path, False, monkeypatch, dtype="float32", block_size=block_size)
    assert off is None
    assert_same(native, python)


@pytest.mark.parametrize("embed_type,tie", [("Q4_1", True), ("Q4_0", True), ("Q5_K", True), ("F32", True),
                                            ("Q8_0", False)])
def test_gguf_embedding_and_head_forms(gguf_dir, monkeypatch, embed_type, tie):
    """Each form of the token table the stack looks up itself (int4 panels with zero points and
    without, GGUF blocks, a float table) and an untied head, native == Python."""
    path = write_gguf(str(gguf_dir / f"embed-{embed_type}-{tie}.gguf"), "Q4_0", embed_type=embed_type, tie=tie)
    native, state = run(path, True, monkeypatch, dtype="float32")
    assert_all_native(state)
    python, _ = run(path, False, monkeypatch, dtype="float32")
    assert_same(native, python)


def test_env_switch(gguf_dir, monkeypatch):
    path = write_gguf(str(gguf_dir / "Q4_0-False.gguf"), "Q4_0")
    monkeypatch.setenv("PAGEDLLM_NATIVE_DECODE", "0")
    llm = LLM(model=path, dtype="float32", kv_cache_memory=8 << 20)
    assert llm.engine.config.native_decode is False


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "bfloat16")])
def test_dense_checkpoint_native_equals_python(make_ckpt, monkeypatch, dtype, kv_cache_dtype):
    """Float32 and bf16 weights; float32 weights over a bfloat16 KV cache as well."""
    path = make_ckpt("native_llama", "llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    native, state = run(path, True, monkeypatch, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    assert_all_native(state)
    python, _ = run(path, False, monkeypatch, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    assert_same(native, python)


def test_families_it_cannot_run_stay_in_python(make_ckpt, monkeypatch):
    path = make_ckpt("native_qwen2", "qwen2", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    outs, state = run(path, True, monkeypatch, dtype="float32")
    assert state is None  # q/k/v biases: the Python layers
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
