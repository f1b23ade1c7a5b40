"""GPTQ checkpoints (reference-packed, as optimum writes them): pagedllm's unpacked weights equal
the reference dequantization exactly, and greedy outputs are HF transformers' on the dense model
with those weights (transformers itself needs gptqmodel + CUDA for GPTQ). 4 and 8 bits, group
sizes 32 and -1, act-order with asymmetric zero points, both checkpoint_formats; resident
weight bytes are the quantized size; tensor parallel 2 gives tensor parallel 1's tokens."""
import os

import pytest

from checkpoints import assert_greedy_agrees, hf_greedy
from packers import gptq_config, quantize_checkpoint
from qhelpers import PROMPTS, SP, assert_weights_equal, engine, model_of, run, tiny_llama, tokens, weight_bytes

CASES = {
    "4bit_g32_sym": dict(cfg=dict(bits=4, group_size=32), opts=dict(bits=4, group_size=32)),
    "4bit_g64_actorder_asym": dict(cfg=dict(bits=4, group_size=64, desc_act=True, sym=False),
                                   opts=dict(bits=4, group_size=64, desc_act=True, sym=False)),
    "8bit_channel_asym_v2": dict(cfg=dict(bits=8, group_size=-1, sym=False, checkpoint_format="gptq_v2"),
                                 opts=dict(bits=8, group_size=-1, sym=False, v2=True)),
}


@pytest.fixture(scope="module")
def dense(ckpt_dir):
    return tiny_llama(ckpt_dir)


def _pack(dense, ckpt_dir, case):
    path = str(ckpt_dir / f"gptq_{case}")
    ref = quantize_checkpoint(dense, path, "gptq", gptq_config(**CASES[case]["cfg"]), **CASES[case]["opts"])
    return path, ref


@pytest.mark.parametrize("case", list(CASES))
def test_gptq_weights_and_greedy(dense, ckpt_dir, case):
    path, ref = _pack(dense, ckpt_dir, case)
    llm = engine(path)
    model = model_of(llm)
    assert assert_weights_equal(model, ref) == 8  # qkv, o, gate_up, down x 2 layers
    outs = run(llm)
    assert_greedy_agrees(outs, hf_greedy(path + "-dequant", PROMPTS, SP.max_tokens), min_compared=0.9)
    if case == "4bit_g32_sym":  # resident weights: the quantized size
        dense_llm = engine(dense)
        q_bytes, d_bytes = weight_bytes(model), weight_bytes(model_of(dense_llm))
        linear = sum(v.numel() * 4 for v in ref.values())  # float32 dense bytes of the quantized layers
        assert d_bytes - q_bytes > 0.8 * linear  # int4 + scales: ~1/7 of float32
        assert not any(p.is_meta for p in model.parameters())
        assert not any(name.endswith(".qweight") for name, _ in model.named_parameters())  # checkpoint tensors dropped


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_gptq_tp2_matches_tp1(dense, ckpt_dir):
    path, _ = _pack(dense, ckpt_dir, "4bit_g32_sym")
    one = tokens(run(engine(path)))
    llm = engine(path, tensor_parallel_size=2)
    try:
        two = tokens(run(llm))
        sizes = llm.engine.core.executor.weight_bytes_per_rank
    finally:
        llm.engine.shutdown()
    assert two == one
    assert len(sizes) == 2


def test_gptq_tp_split_through_a_group_is_refused(dense, ckpt_dir):
    """down_proj's 256 inputs split over 2 ranks = 128 each; group 96 does not divide them."""
    path, _ = _pack(dense, ckpt_dir, "4bit_g64_actorder_asym")
    with pytest.raises(Exception, match="act-order|desc_act|group"):
        engine(path, tensor_parallel_size=2)
