"""FP8 checkpoints (``quant_method: fp8``) and int8 / fp8 quantization at load.

FP8 per-tensor with dynamic activations computes what HF transformers + compressed-tensors
compute on the same weights and scales written as a float-quantized checkpoint (tensor weights,
dynamic per-tensor activations): greedy tokens identical. A per-tensor activation scale spans the
whole step's [tokens, features] input (as in vLLM), so the engine runs one sequence at a time
here, the way HF's generate does. FP8 block scales ([32, 32] here): weights
equal the reference dequantization; activations are quantized per token (not per 1 x 32 group as
the block recipe does), so greedy tokens agree with the dense dequantized model up to near-ties.
``quantization="int8"`` / ``"fp8"`` on a dense checkpoint: every weight row within its
quantization error (int8: s/2 with s = absmax/127; e4m3: 2**-4 relative, plus the subnormal step),
resident weights smaller, greedy tokens the dense model's up to near-ties (0.02 nats for int8,
0.1 for fp8)."""
import pytest
import torch
from safetensors.torch import load_file

from checkpoints import assert_greedy_agrees, hf_greedy
from packers import ct_config, quantize_checkpoint
from qhelpers import FUSED, PROMPTS, SP, assert_weights_equal, engine, model_of, run, runtime, tiny_llama, tokens, weight_bytes  # noqa: F401

FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}


@pytest.fixture(scope="module")
def dense(ckpt_dir):
    return tiny_llama(ckpt_dir)


def test_fp8_per_tensor_matches_hf_compressed_tensors(dense, ckpt_dir):
    pytest.importorskip("compressed_tensors")
    path = str(ckpt_dir / "fp8_tensor")
    ref = quantize_checkpoint(dense, path, "fp8", FP8_CONFIG, per_channel=False)
    twin = str(ckpt_dir / "fp8_tensor_ct")
    acts = {"num_bits": 8, "strategy": "tensor", "dynamic": True, "symmetric": True, "type": "float"}
    quantize_checkpoint(dense, twin, "ct-float", ct_config("float-quantized", {"num_bits": 8, "strategy": "tensor",
                                                                               "type": "float"}, acts), per_channel=False)
    llm = engine(path, max_num_seqs=1)  # per-tensor activation scales span a step: one sequence, as HF runs
    model = model_of(llm)
    assert assert_weights_equal(model, ref) == 8
    qkv = runtime(model.model.layers[0].self_attn.qkv_proj.quantized)
    assert qkv.act_quant == "fp8_per_tensor" and qkv.scales.unique().numel() == 3  # q, k, v keep their scales
    assert_greedy_agrees(run(llm), hf_greedy(twin, PROMPTS, SP.max_tokens), min_compared=0.9)


def test_fp8_block_scales(dense, ckpt_dir):
    pytest.importorskip("compressed_tensors")
    path = str(ckpt_dir / "fp8_block")
    ref = quantize_checkpoint(dense, path, "fp8", dict(FP8_CONFIG, weight_block_size=[32, 32]), block=(32, 32))
    twin = str(ckpt_dir / "fp8_block_ct")  # the same weights and block scales, per-token activations
    acts = {"num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True, "type": "float"}
    weights = {"num_bits": 8, "strategy": "block", "block_structure": [32, 32], "type": "float"}
    quantize_checkpoint(dense, twin, "ct-float", ct_config("float-quantized", weights, acts), block=(32, 32))
    llm = engine(path)
    assert assert_weights_equal(model_of(llm), ref) == 8
    assert_greedy_agrees(run(llm), hf_greedy(twin, PROMPTS, SP.max_tokens), min_compared=0.9)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_at_load(dense, kind):
    llm = engine(dense, quantization=kind)
    model = model_of(llm)
    tensors = load_file(f"{dense}/model.safetensors")
    checked = 0
    for name, module in model.named_modules():
        qw = getattr(module, "quantized", None)
        if qw is None:
            continue
        qw = runtime(qw)
        prefix, leaf = name.rsplit(".", 1)
        w = torch.cat([tensors[f"{prefix}.{p}.weight"] for p in FUSED.get(leaf, (leaf,))]).float()
        s = qw.scales  # [N, 1]: one scale per output channel
        assert qw.kind == kind and qw.group_size == qw.in_features and qw.act_quant is None
        assert torch.allclose(s[:, 0], w.abs().amax(1) / (127.0 if kind == "int8" else 448.0))
        err = (qw.dequantize() - w).abs()
        bound = s / 2 * 1.0001 if kind == "int8" else w.abs() * 2.0**-4 + s * 2.0**-9
        assert bool((err <= bound).all()), f"{name}: error {float((err - bound).max())} past the bound"
        checked += 1
    assert checked == 8
    dense_llm = engine(dense)
    d_bytes, q_bytes = weight_bytes(model_of(dense_llm)), weight_bytes(model)
    linear = sum(t.numel() * 4 for n, t in tensors.items() if n.endswith("_proj.weight"))
    assert d_bytes - q_bytes > 0.7 * linear  # 1 byte instead of 4 per weight, plus a scale per row
    _assert_close_to(run(llm), tokens(run(dense_llm)), *((0.02, 0.5) if kind == "int8" else (0.1, 0.4)))


def _assert_close_to(outs, reference, margin: float, min_compared: float) -> None:
    """Greedy tokens equal ``reference`` until a step whose top-2 logprobs lie within ``margin``
    nats (8-bit weight error moves logprobs by a few hundredths: 0.02 for int8, 0.1 for e4m3's
    3-bit mantissa); at least ``min_compared`` of the tokens are compared."""
    compared = total = 0
    for out, ref in zip(outs, reference):
        total += len(ref)
        for i, (a, b) in enumerate(zip(out.outputs[0].token_ids, ref)):
            if a != b:
                top = sorted(lp.logprob for lp in out.outputs[0].logprobs[i].values())[::-1]
                assert top[0] - top[1] < margin, f"token {i}: {a} vs dense {b}, margin {top[0] - top[1]:.4f}"
                break
            compared += 1
    assert compared >= min_compared * total
