"""AWQ (AutoAWQ gemm layout, 4 bit, zero points) on a Qwen2 checkpoint (q/k/v biases stay dense
beside the packed weights): unpacked weights equal the reference dequantization exactly, greedy
outputs are HF transformers' on the dense model with those weights (transformers needs gptqmodel
or autoawq for AWQ itself)."""
from checkpoints import assert_greedy_agrees, hf_greedy
from packers import awq_config, quantize_checkpoint
from qhelpers import PROMPTS, SP, assert_weights_equal, engine, model_of, run, tiny_llama


def test_awq_qwen2_weights_and_greedy(ckpt_dir):
    dense = tiny_llama(ckpt_dir, "qwen2")
    path = str(ckpt_dir / "awq_qwen2")
    ref = quantize_checkpoint(dense, path, "awq", awq_config(group_size=64), group_size=64)
    llm = engine(path)
    model = model_of(llm)
    assert assert_weights_equal(model, ref) == 8
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert_greedy_agrees(run(llm), hf_greedy(path + "-dequant", PROMPTS, SP.max_tokens), min_compared=0.9)
