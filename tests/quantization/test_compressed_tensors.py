"""compressed-tensors checkpoints in llm-compressor's layout, loaded beside HF transformers with the
compressed-tensors package (a test-only dependency): its decompression is the reference for the
weights (exact equality) and its forward (which fake-quantizes activations for W8A8 / FP8 the way
the scheme says) for greedy tokens. Asymmetric pack-quantized zero points, which transformers
5.24 + compressed-tensors 0.20 cannot load (they expect the zero points unpacked), are checked
against the packer's reference dequantization instead. The ignore list leaves layers dense."""
import pytest
import torch

from checkpoints import assert_greedy_agrees, hf_greedy
from packers import ct_config, quantize_checkpoint
from qhelpers import PROMPTS, SP, assert_weights_equal, engine, model_of, run, runtime, tiny_llama

pytest.importorskip("compressed_tensors")

INT8_TOKEN = {"num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True, "type": "int"}
FP8_TOKEN = {"num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True, "type": "float"}
CASES = {  # name: (format, weights, input activations, packer format, packer options, expected kind/act)
    "w4a16_group": ("pack-quantized", {"num_bits": 4, "strategy": "group", "group_size": 32}, None, "ct-pack",
                    dict(bits=4, group_size=32), ("int4", None)),
    "w8a8_int_dynamic": ("int-quantized", {"num_bits": 8, "strategy": "channel"}, INT8_TOKEN, "ct-int", {},
                         ("int8", "int8_per_token")),
    "fp8_w8a8_dynamic": ("float-quantized", {"num_bits": 8, "strategy": "channel", "type": "float"}, FP8_TOKEN,
                         "ct-float", {}, ("fp8", "fp8_per_token")),
}


def _tool_weight(path: str, module: str, weights: dict) -> torch.Tensor:
    """compressed-tensors' own decompression of one packed module of the checkpoint."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    tensors = load_file(f"{path}/model.safetensors")
    state = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".")}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"]


@pytest.fixture(scope="module")
def dense(ckpt_dir):
    return tiny_llama(ckpt_dir)


@pytest.mark.parametrize("case", list(CASES))
def test_ct_matches_hf(dense, ckpt_dir, case):
    fmt, weights, acts, pack, opts, (kind, act) = CASES[case]
    path = str(ckpt_dir / f"ct_{case}")
    ref = quantize_checkpoint(dense, path, pack, ct_config(fmt, weights, acts), **opts)
    llm = engine(path)
    model = model_of(llm)
    assert assert_weights_equal(model, ref) == 8
    qw = model.model.layers[1].mlp.down_proj.quantized
    assert (qw.kind, qw.act_quant) == (kind, act)
    if case == "w4a16_group":  # the tool's own decompression gives the same weight
        assert torch.equal(_tool_weight(path, "model.layers.1.mlp.down_proj", weights), qw.dequantize())
    # int8 activations: compressed-tensors scales rows by absmax / 127.5 (clamp -128..127), pagedllm
    # (as vLLM) by absmax / 127: the same tokens except after near-ties, which come a little sooner
    assert_greedy_agrees(run(llm), hf_greedy(path, PROMPTS, SP.max_tokens),
                         min_compared=0.7 if act == "int8_per_token" else 0.9)


def test_ct_asymmetric_pack_and_ignore_list(dense, ckpt_dir):
    path = str(ckpt_dir / "ct_w4a16_asym")
    qc = ct_config("pack-quantized", {"num_bits": 4, "strategy": "group", "group_size": 64, "symmetric": False},
                   ignore=("lm_head", "re:.*down_proj$"))
    ref = quantize_checkpoint(dense, path, "ct-pack", qc, skip=(r"down_proj",), bits=4, group_size=64, sym=False)
    llm = engine(path)
    model = model_of(llm)
    assert assert_weights_equal(model, ref) == 6  # down_proj ignored: dense
    down = model.model.layers[0].mlp.down_proj
    assert down.quant_method is None and down.weight.dtype == torch.float32
    assert runtime(model.model.layers[0].mlp.gate_up_proj.quantized).zeros is not None
    assert_greedy_agrees(run(llm), hf_greedy(path + "-dequant", PROMPTS, SP.max_tokens), min_compared=0.9)


def test_ct_static_fp8_input_scale(dense, ckpt_dir):
    """Static per-tensor activation scales (FP8 W8A8 static): the fused q/k/v take the largest of
    their three input_scales; HF's compressed-tensors forward is the reference."""
    path = str(ckpt_dir / "ct_fp8_static")
    static = {"num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True, "type": "float"}
    qc = ct_config("float-quantized", {"num_bits": 8, "strategy": "tensor", "type": "float"}, static)
    quantize_checkpoint(dense, path, "ct-float", qc, per_channel=False, input_scale=0.02)
    llm = engine(path)
    layer = model_of(llm).model.layers[0].self_attn.qkv_proj
    assert layer.static_input == ("fp8", pytest.approx(0.02))
    assert_greedy_agrees(run(llm), hf_greedy(path, PROMPTS, SP.max_tokens), min_compared=0.9)
