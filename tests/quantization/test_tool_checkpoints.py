"""Checkpoints made by the real quantization tools (tests/quantization/tool_checkpoints/, made by
make_tool_checkpoints.py with llm-compressor (0.14 and 0.13), gptqmodel and autoawq in throwaway
virtualenvs;
VERSIONS.txt says with what): pagedllm detects the format from config.json, loads it, and

- its unpacked weights equal the tool's own dequantization bit for bit: the sha256 that the tool's
  dequantizer gave at make time (in the dtype it returns, the checkpoint's bfloat16 / float16), and
  a float32 decoding of the same tensors (exact products): the installed compressed-tensors
  decompressor on float32 scales, or, for GPTQ / AWQ and compressed-tensors act-order "group"
  (which compressed-tensors 0.20 no longer reads), the formats' documented unpacking written here
  (checked against the tool by the same sha256);
- greedy tokens equal HF transformers loading the same checkpoint (compressed-tensors: through the
  compressed-tensors package, which fake-quantizes activations as the scheme says for FP8); where
  transformers cannot load it on CPU (GPTQ / AWQ need gptqmodel, packed asymmetric zero points),
  the dense model with the float32 dequantized weights, for W8A8 with its linear inputs
  fake-quantized per token as pagedllm does;
- tensor parallel 2 gives tensor parallel 1's tokens.
"""
import hashlib
import json
import os

import pytest
import torch
from checkpoints import assert_greedy_agrees, hf_greedy, hf_model
from prompts import random_prompts
from qhelpers import FUSED, SP, engine, model_of, run, tokens
from safetensors.torch import load_file, save_file

from pagedllm.quantization.registry import resolve_quantization

pytest.importorskip("compressed_tensors")

DIR = os.path.join(os.path.dirname(__file__), "tool_checkpoints")
PROMPTS = random_prompts((3, 17, 40), vocab=256, seed=5)
# name: (pagedllm kind / act_quant of a linear layer, greedy reference, share of tokens compared before a near-tie)
CASES = {
    "gptq_4bit_g32_actorder_asym": (("int4", None), "dense", 0.9),  # desc_act: g_idx, columns permuted at load
    "gptq_4bit_g64_sym": (("int4", None), "dense", 0.9),
    "gptq_8bit_channel_sym": (("int8", None), "dense", 0.9),
    "awq_4bit_g32": (("int4", None), "dense", 0.9),
    "ct_w4a16_g32_gptq": (("int4", None), "hf", 0.9),
    # transformers 5.24 + compressed-tensors 0.20 do not load packed asymmetric zero points
    "ct_w4a16_asym_g64_gptq": (("int4", None), "dense", 0.9),
    # llm-compressor 0.13's act-order "group": weight_g_idx, which compressed-tensors 0.20 no longer reads
    "ct_w4a16_asym_g64_actorder_group": (("int4", None), "dense", 0.9),
    "ct_w8a16_gptq": (("int8", None), "hf", 0.9),
    # int8 activations: compressed-tensors' forward scales a row by absmax / 127.5 (clamp -128..127), pagedllm
    # (as vLLM) by absmax / 127 (clamp -127..127), which splits greedy runs early on this flat tiny model: the
    # reference is the dense model whose linear inputs are fake-quantized per token as pagedllm does
    "ct_w8a8_int": (("int8", "int8_per_token"), "dense_int8_per_token", 0.9),
    "ct_fp8_dynamic": (("fp8", "fp8_per_token"), "hf", 0.9),
    "ct_fp8_static": (("fp8", None), "hf", 0.9),
    "ct_fp8_block_w8a16": (("fp8", None), "hf", 0.9),
    "ct_awq_w4a16_asym": (("int4", None), "dense", 0.9),
}


def _path(case: str) -> str:
    path = os.path.join(DIR, case)
    if not os.path.exists(os.path.join(path, "reference.json")):
        pytest.fail(f"{path} is missing: make it with make_tool_checkpoints.py (see VERSIONS.txt)")
    return path


def _reference(path: str) -> dict:
    with open(os.path.join(path, "reference.json")) as f:
        return json.load(f)["modules"]


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _unpack(words: torch.Tensor, bits: int, axis: int) -> torch.Tensor:
    """int32 words -> unsigned codes; the code at bits ``j * bits`` of word ``i`` along ``axis``
    is element ``i * (32 // bits) + j`` there."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per) * bits
    if axis == 0:
        return ((w.unsqueeze(1) >> shifts.view(1, per, 1)) & (2**bits - 1)).reshape(-1, w.shape[1])
    return ((w.unsqueeze(-1) >> shifts) & (2**bits - 1)).reshape(w.shape[0], -1)


def _gptq_float32(path: str, qc: dict) -> dict:
    """GPTQ (``checkpoint_format: gptq``): qweight packed along K, qzeros along N stored minus one,
    ``w[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]``."""
    assert qc["checkpoint_format"] == "gptq"
    t = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for key in t:
        if key.endswith(".qweight"):
            m, bits = key[: -len(".qweight")], qc["bits"]
            q = _unpack(t[key], bits, 0)
            z = _unpack(t[f"{m}.qzeros"], bits, 1) + 1
            g = t[f"{m}.g_idx"].long()
            out[m] = ((q - z[g]).float() * t[f"{m}.scales"].float()[g]).t().contiguous()
    return out


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column 8i + AWQ_ORDER[j]


def _awq_float32(path: str, qc: dict) -> dict:
    """AWQ GEMM: qweight / qzeros packed along N in the 0,2,4,6,1,3,5,7 order,
    ``w[n, k] = (q[k, n] - z[k // group, n]) * scales[k // group, n]``."""
    t = load_file(os.path.join(path, "model.safetensors"))

    def unpack(words):
        nib = _unpack(words, 4, 1).view(words.shape[0], -1, 8)
        out = torch.empty_like(nib)
        out[:, :, list(AWQ_ORDER)] = nib
        return out.reshape(words.shape[0], -1)

    out = {}
    for key in t:
        if key.endswith(".qweight"):
            m = key[: -len(".qweight")]
            q, z = unpack(t[key]), unpack(t[f"{m}.qzeros"])
            g = torch.arange(q.shape[0]) // qc["group_size"]
            out[m] = ((q - z[g]).float() * t[f"{m}.scales"].float()[g]).t().contiguous()
    return out


def _ct_pack_g_idx_float32(state: dict, bits: int) -> torch.Tensor:
    """compressed-tensors pack-quantized with ``weight_g_idx`` (act-order "group"), which the
    installed decompressor ignores: codes ``q + 2**(bits-1)`` packed along K, zero points the same
    way along N, ``w[n, k] = (q[n, k] - z[n, g_idx[k]]) * scale[n, g_idx[k]]``."""
    n, k = state["weight_shape"].tolist()
    codes = _unpack(state["weight_packed"], bits, 1)[:, :k]
    zeros = _unpack(state["weight_zero_point"], bits, 0)[:n] if "weight_zero_point" in state else 2 ** (bits - 1)
    g = state["weight_g_idx"].long()
    zeros = zeros[:, g] if torch.is_tensor(zeros) else zeros
    return (codes - zeros).float() * state["weight_scale"].float()[:, g]


def _dequantized_float32(path: str) -> dict:
    """{module: float32 weight}: the products of codes and scales, exact. compressed-tensors: the
    installed decompressor on the checkpoint's tensors with the scales widened to float32."""
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    if qc["quant_method"] == "gptq":
        return _gptq_float32(path, qc)
    if qc["quant_method"] == "awq":
        return _awq_float32(path, qc)
    if qc["config_groups"]["group_0"]["weights"].get("actorder") == "group":  # 0.20 refuses to parse it
        tensors = load_file(os.path.join(path, "model.safetensors"))
        bits = qc["config_groups"]["group_0"]["weights"]["num_bits"]
        return {m: _ct_pack_g_idx_float32({k[len(m) + 1:]: v for k, v in tensors.items() if k.startswith(m + ".")},
                                          bits) for m in _reference(path)}
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(qc)
    scheme = qc.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for module in _reference(path):
        state = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".")}
        state["weight_scale"] = state["weight_scale"].float()
        out[module] = compressor.decompress(state, scheme)["weight"]
    return out


def _by_module(model) -> dict:
    """{checkpoint module: pagedllm's float32 dequantized weight} (fused layers split by rows)."""
    out = {}
    for name, module in model.named_modules():
        qw = getattr(module, "quantized", None)
        if qw is None:
            continue
        prefix, leaf = name.rsplit(".", 1)
        w = qw.dequantize()
        parts = FUSED.get(leaf, (leaf,))
        rows = [module.output_sizes[i] for i in range(len(parts))] if len(parts) > 1 else [w.shape[0]]
        for part, piece in zip(parts, torch.split(w, rows)):
            out[f"{prefix}.{part}"] = piece
    return out


def _hf_greedy_int8_inputs(path: str, modules) -> list:
    """HF greedy on the dense copy ``path`` with the inputs of ``modules`` fake-quantized per token
    as pagedllm quantizes them: ``s = absmax(row) / 127`` (rows of zeros: 1),
    ``x' = clamp(round(x / s), -127, 127) * s``."""

    def fake_quant(_module, args):
        x = args[0]
        s = x.abs().amax(-1, keepdim=True) / 127
        s = torch.where(s == 0, torch.ones_like(s), s)
        return (torch.clamp(torch.round(x / s), -127, 127) * s,) + args[1:]

    m = hf_model(path)
    hooked = [mod.register_forward_pre_hook(fake_quant) for name, mod in m.named_modules() if name in modules]
    assert len(hooked) == len(modules)
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=SP.max_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0, min_new_tokens=SP.max_tokens)
            outs.append(g[0, len(p):].tolist())
    return outs


def _dense_copy(path: str, dst: str, weights: dict) -> str:
    """The checkpoint with its quantized modules replaced by dense float32 ``weights``."""
    os.makedirs(dst, exist_ok=True)
    tensors = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
               if k.rsplit(".", 1)[0] not in weights}
    tensors.update({f"{m}.weight": w.contiguous() for m, w in weights.items()})
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(path):
        if f.startswith("tokenizer") or f.endswith(".jinja"):
            with open(os.path.join(path, f), "rb") as src, open(os.path.join(dst, f), "wb") as out:
                out.write(src.read())
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("case", list(CASES))
def test_tool_checkpoint(case, tmp_path):
    (kind, act), greedy_ref, min_compared = CASES[case]
    path = _path(case)
    with open(os.path.join(path, "config.json")) as f:
        method = json.load(f)["quantization_config"]["quant_method"]
    assert resolve_quantization(path, None).name == method
    ref = _reference(path)
    llm = engine(path)
    model = model_of(llm)
    got = _by_module(model)
    assert sorted(got) == sorted(ref)  # every layer the tool quantized, and only those (lm_head is ignored)
    assert model.lm_head.weight.dtype == torch.float32
    qw = model.model.layers[1].mlp.down_proj.quantized
    assert (qw.kind, qw.act_quant) == (kind, act)
    exact = _dequantized_float32(path)
    for module, r in ref.items():
        w = got[module]
        assert list(w.shape) == r["shape"], module
        assert _sha256(w.to(getattr(torch, r["dtype"]))) == r["sha256"], f"{module}: not the tool's dequantization"
        assert torch.equal(w, exact[module]), f"{module}: max diff {(w - exact[module]).abs().max()}"
    if greedy_ref == "hf":
        expected = hf_greedy(path, PROMPTS, SP.max_tokens)
    elif greedy_ref == "dense":
        expected = hf_greedy(_dense_copy(path, str(tmp_path / "dense"), exact), PROMPTS, SP.max_tokens)
    else:
        expected = _hf_greedy_int8_inputs(_dense_copy(path, str(tmp_path / "dense"), exact), exact)
    assert_greedy_agrees(run(llm, PROMPTS), expected, min_compared=min_compared)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
@pytest.mark.parametrize("case", ["gptq_4bit_g64_sym", "ct_w8a8_int"])
def test_tool_checkpoint_tp2_matches_tp1(case):
    path = _path(case)
    one = tokens(run(engine(path), PROMPTS))
    llm = engine(path, tensor_parallel_size=2)
    try:
        two = tokens(run(llm, PROMPTS))
    finally:
        llm.engine.shutdown()
    assert two == one
