"""Detection, overrides and refusals: formats pagedllm does not load fail at load naming the format
and listing the supported ones; a request that contradicts the checkpoint fails; an MoE checkpoint
whose experts are quantized is refused, one whose experts stay dense loads (the routed experts and
router run dense, the attention and shared expert quantized) and matches HF on its dequantization."""
import json
import os
import shutil

import pytest

from checkpoints import assert_greedy_agrees, hf_greedy, make_checkpoint
from packers import gptq_config, quantize_checkpoint
from pagedllm.config import EngineConfig
from qhelpers import PROMPTS, SP, assert_weights_equal, engine, model_of, run, tiny_llama


@pytest.fixture(scope="module")
def dense(ckpt_dir):
    return tiny_llama(ckpt_dir)


def _with_qconfig(src: str, dst: str, qc: dict) -> str:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("method", ["bitsandbytes", "gguf", "exl2", "hqq", "eetq", "aqlm", "bogus"])
def test_unsupported_checkpoint_formats_are_refused(dense, tmp_path, method):
    path = _with_qconfig(dense, str(tmp_path / method), {"quant_method": method, "load_in_4bit": True})
    with pytest.raises(ValueError, match=rf"{method}.*supported: gptq.*awq.*compressed-tensors.*fp8"):
        engine(path)


def test_requested_quantization_is_checked(dense, ckpt_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model=dense, quantization="bitsandbytes")
    with pytest.raises(ValueError, match="has no quantization_config"):
        engine(dense, quantization="gptq")
    path = str(ckpt_dir / "detect_gptq")
    quantize_checkpoint(dense, path, "gptq", gptq_config())
    with pytest.raises(ValueError, match="requested but the checkpoint is quantized with 'gptq'"):
        engine(path, quantization="awq")
    with pytest.raises(ValueError, match="GPTQ with 3 bits is not supported"):
        engine(_with_qconfig(path, str(ckpt_dir / "detect_gptq3"), gptq_config(bits=3)))
    assert EngineConfig(model=path, quantization="GPTQ").quantization == "gptq"


MOE = dict(arch="qwen2_moe", layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, init_std=0.05,
           extra=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64, norm_topk_prob=False))


def test_moe_experts(ckpt_dir):
    dense = make_checkpoint(str(ckpt_dir / "moe_dense"), **MOE)
    quantized_experts = str(ckpt_dir / "moe_gptq_experts")
    quantize_checkpoint(dense, quantized_experts, "gptq", gptq_config())
    with pytest.raises(ValueError, match="quantizes the MoE experts"):
        engine(quantized_experts)
    path = str(ckpt_dir / "moe_gptq")
    ref = quantize_checkpoint(dense, path, "gptq", gptq_config(), skip=(r"\.experts\.",))
    llm = engine(path)
    model = model_of(llm)
    assert assert_weights_equal(model, ref) == 8  # qkv, o, shared gate_up, shared down x 2 layers
    assert_greedy_agrees(run(llm), hf_greedy(path + "-dequant", PROMPTS, SP.max_tokens), min_compared=0.9)
