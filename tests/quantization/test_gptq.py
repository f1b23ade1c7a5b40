"""GPTQ checkpoints (reference-packed, as optimum writes them): pagedllm's unpacked weights equal
the reference dequantization exactly, and greedy outputs are HF transformers' on the dense model
with those weights (transformers itself needs gptqmodel + CUDA for GPTQ). 4 and 8 bits, group
sizes 32 and -1, act-order with asymmetric zero points, both checkpoint_formats; resident
weight bytes are the quantized size; tensor parallel 2 gives tensor parallel 1's tokens."""
import os

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import assert_greedy_agrees, hf_greedy
from packers import gptq_config, quantize_checkpoint
from pagedllm.quantization.base import LinearPartition
from pagedllm.quantization.gptq import GPTQMethod
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


def _load_layer(method, part, tensors: dict, name: str, shard=None):
    layer = torch.nn.Module()
    method.create_weights(layer, part, name)
    for suffix in layer.checkpoint_param_names:
        param = getattr(layer, suffix)
        param.weight_loader(param, tensors[f"{name}.{suffix}"], *(() if shard is None else (shard,)))
    method.process_after_loading(layer)
    return layer


def test_gptq_tp_splits_through_groups_or_words_are_refused(dense, ckpt_dir):
    """Act-order groups scatter over K, so rank 1 of 2 of a row-parallel down_proj (inputs 128..255)
    holds parts of groups: refused naming the layer. Rank 0 of 2 of a qkv layer whose 8-per-word
    zero points would split inside a word: refused too. Rank 1 of 2 without act-order: the right
    half of the reference weight, exactly."""
    path, ref = _pack(dense, ckpt_dir, "4bit_g64_actorder_asym")
    tensors = load_file(f"{path}/model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    row = LinearPartition(128, 256, 128, 128, ((None, 0, 128, 0),))
    method = GPTQMethod(4, 64, desc_act=True, v2=False)
    with pytest.raises(ValueError, match=f"{name}: act-order"):
        _load_layer(method, row, tensors, name)
    path, ref = _pack(dense, ckpt_dir, "4bit_g32_sym")
    tensors = load_file(f"{path}/model.safetensors")
    layer = _load_layer(GPTQMethod(4, 32, desc_act=False, v2=False), row, tensors, name)
    assert torch.equal(layer.quantized.dequantize(), ref[name][:, 128:])
    odd = LinearPartition(128, 128, 0, 60, (("q", 0, 60, 0),))
    with pytest.raises(ValueError, match="packing needs|packed units"):
        _load_layer(GPTQMethod(4, 32, desc_act=False, v2=False), odd, tensors, "model.layers.0.self_attn.qkv_proj",
                    "q")
