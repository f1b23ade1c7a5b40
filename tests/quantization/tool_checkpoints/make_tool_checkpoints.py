"""Make the committed tool checkpoints: a tiny random Llama quantized by the real quantization tools.

The tools do not install beside pagedllm's pins (nor beside each other), so this runs once, by
hand, in one throwaway virtualenv per tool, each started from the CPU torch wheel (VERSIONS.txt
has the exact versions and commands of the last run of each):

    python3.11 -m venv /tmp/qtools-venv
    /tmp/qtools-venv/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    /tmp/qtools-venv/bin/pip install llmcompressor==0.14.0.1
    /tmp/qtools-venv/bin/python tests/quantization/tool_checkpoints/make_tool_checkpoints.py llmcompressor

    # the same with llmcompressor==0.13.0 (compressed-tensors 0.18, transformers 5.14.1) in
    # /tmp/lc-old-venv, the last release that writes act-order "group" (weight_g_idx)
    /tmp/lc-old-venv/bin/python tests/quantization/tool_checkpoints/make_tool_checkpoints.py llmcompressor-0.13

    # gptqmodel 7.0.0 is the newest that installs beside torch 2.13 (7.7 wants torch >= 2.14.1);
    # it needs transformers <= 5.8 (5.24 dropped transformers.utils.hub.create_repo) and requests
    echo 'torch==2.13.0+cpu' > /tmp/torchpin.txt
    PIP_CONSTRAINT=/tmp/torchpin.txt /tmp/gptq-venv/bin/pip install gptqmodel==7.0.0 transformers==5.8.1 requests
    /tmp/gptq-venv/bin/python tests/quantization/tool_checkpoints/make_tool_checkpoints.py gptqmodel

    /tmp/awq-venv/bin/pip install autoawq==0.2.9
    /tmp/awq-venv/bin/python tests/quantization/tool_checkpoints/make_tool_checkpoints.py autoawq

Every checkpoint starts from the same dense model: tests/checkpoints.py's make_checkpoint with
the shapes of tests/quantization (hidden 128, 4 heads / 2 KV heads, intermediate 256, 2 layers),
vocab 256 (each checkpoint stays a few hundred KB), in bfloat16 for llm-compressor and float16 for
the GPTQ / AWQ tools (the dtype their formats store scales in), calibrated on 16 sequences of 64
random token ids. Each <name>/ holds what the tool saved, untouched (config.json with its
quantization_config, model.safetensors, the tool's own side files), the word-level tokenizer of the
other test checkpoints, and reference.json: for every quantized module the sha256 of the tool's
own dequantization of the saved tensors (in the dtype the tool returns it) with its dtype, shape
and sum; the tests compare pagedllm's unpacked weights to it bit for bit without the tools.

- llm-compressor: compressed-tensors' decompressor of the checkpoint's format
  (``BaseCompressor.get_value_from_registry(format).decompress``);
- gptqmodel: the saved checkpoint loaded back with its torch kernel, ``dequantize_weight()``;
- autoawq: ``awq.utils.packing_utils.dequantize_gemm`` on the saved qweight / qzeros / scales.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, TESTS)

from checkpoints import _tokenizer_files, make_checkpoint  # noqa: E402

VOCAB = 256
SHAPES = dict(vocab_size=VOCAB, hidden=128, intermediate=256, heads=4, kv_heads=2, layers=2, init_std=0.05)


def calibration_ids(n=16, length=64, seed=0) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, length), generator=g).tolist()


# --- llm-compressor (compressed-tensors checkpoints) ---------------------------------------------

def _ct_weights(bits, strategy="group", group_size=None, symmetric=True, actorder=None, type_="int"):
    w = dict(num_bits=bits, type=type_, strategy=strategy, symmetric=symmetric, dynamic=False)
    if group_size is not None:
        w["group_size"] = group_size
    if actorder is not None:
        w["actorder"] = actorder
    return w


def _llmcompressor_recipe(name: str):
    """The recipe of one checkpoint (lm_head stays dense, as in the tool's examples)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier

    def groups(w, acts=None):
        g = {"targets": ["Linear"], "weights": w}
        if acts is not None:
            g["input_activations"] = acts
        return {"group_0": g}

    if name == "ct_w4a16_g32_gptq":  # GPTQ, symmetric int4, group 32
        return GPTQModifier(config_groups=groups(_ct_weights(4, group_size=32)), ignore=["lm_head"])
    if name == "ct_w4a16_asym_g64_gptq":  # GPTQ, asymmetric int4, group 64, act-order "weight" (0.14 has no
        # "group" act-order any more, so no weight_g_idx: the columns are only visited in activation order)
        return GPTQModifier(config_groups=groups(_ct_weights(4, group_size=64, symmetric=False, actorder="weight")),
                            ignore=["lm_head"])
    if name == "ct_w4a16_asym_g64_actorder_group":  # llm-compressor 0.13 only: act-order "group", weight_g_idx
        return GPTQModifier(config_groups=groups(_ct_weights(4, group_size=64, symmetric=False, actorder="group")),
                            ignore=["lm_head"])
    if name == "ct_w8a16_gptq":  # the W8A16 preset: int8, group 128
        return GPTQModifier(scheme="W8A16", targets=["Linear"], ignore=["lm_head"])
    if name == "ct_w8a8_int":  # the W8A8 preset: int8 per channel, dynamic per-token int8 activations
        return GPTQModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"])
    if name == "ct_fp8_dynamic":  # the FP8_DYNAMIC preset: fp8 per channel, dynamic per-token fp8 activations
        return QuantizationModifier(scheme="FP8_DYNAMIC", targets=["Linear"], ignore=["lm_head"])
    if name == "ct_fp8_static":  # the FP8 preset: fp8 per tensor, static per-tensor activation scales
        return QuantizationModifier(scheme="FP8", targets=["Linear"], ignore=["lm_head"])
    if name == "ct_fp8_block_w8a16":  # fp8 weights in 128 x 128 blocks (FP8_BLOCK's), activations left alone
        return QuantizationModifier(config_groups=groups(dict(_ct_weights(8, "block", type_="float"),
                                                              block_structure=[128, 128])), ignore=["lm_head"])
    if name == "ct_awq_w4a16_asym":  # AWQ smoothing, then asymmetric int4 group 32 (the W4A16_ASYM preset's shape)
        return [AWQModifier(duo_scaling="both"),
                QuantizationModifier(config_groups=groups(_ct_weights(4, group_size=32, symmetric=False)),
                                     ignore=["lm_head"])]
    raise ValueError(name)


def _cpu_without_pinned_memory() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations for host-to-device copies, which raises
    without an accelerator; on CPU they are used where they are, so pinning is skipped."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def make_llmcompressor(name: str, dense: str, out: str) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    ids = calibration_ids()
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16)
    if not torch.cuda.is_available():
        _cpu_without_pinned_memory()
    data_free = name in ("ct_fp8_dynamic", "ct_fp8_block_w8a16")
    oneshot(model=model, dataset=data, recipe=_llmcompressor_recipe(name), num_calibration_samples=len(ids),
            max_seq_length=64, pipeline="datafree" if data_free else "sequential")
    model.save_pretrained(out, save_compressed=True)


def dequant_llmcompressor(out: str) -> dict:
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    with open(os.path.join(out, "config.json")) as f:
        qc = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    tensors = load_file(os.path.join(out, "model.safetensors"))
    (scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")})
    return {m: compressor.decompress({k[len(m) + 1:]: v for k, v in tensors.items() if k.startswith(m + ".")},
                                     scheme)["weight"] for m in modules}


# --- gptqmodel (quant_method gptq) -------------------------------------------------------------

GPTQ = {  # name: QuantizeConfig arguments
    "gptq_4bit_g32_actorder_asym": dict(bits=4, group_size=32, desc_act=True, sym=False),
    "gptq_4bit_g64_sym": dict(bits=4, group_size=64, desc_act=False, sym=True),
    # group-aware reordering (on by default without desc_act) needs groups: off for per-channel scales
    "gptq_8bit_channel_sym": dict(bits=8, group_size=-1, desc_act=False, sym=True, act_group_aware=False),
}


def _without_torchvision() -> None:
    """gptqmodel 7.0 imports torchvision.transforms for its InternVL definition only; PyPI's
    torchvision links the CUDA torch libraries, so with the CPU torch a stub stands in."""
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached False before the stub exists
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.modules["torchvision.transforms"].functional = sys.modules["torchvision.transforms.functional"]
    sys.modules["torchvision.transforms.functional"].InterpolationMode = None


def make_gptqmodel(name: str, dense: str, out: str) -> None:
    _without_torchvision()
    from gptqmodel import GPTQModel, QuantizeConfig

    calib = [{"input_ids": r, "attention_mask": [1] * len(r)} for r in calibration_ids()]
    model = GPTQModel.load(dense, QuantizeConfig(**GPTQ[name]), device="cpu")
    model.quantize(calib, batch_size=1)
    model.save(out)


def dequant_gptqmodel(out: str) -> dict:
    _without_torchvision()
    from gptqmodel import BACKEND, GPTQModel

    model = GPTQModel.load(out, device="cpu", backend=BACKEND.GPTQ_TORCH, dtype=torch.float16)  # as saved
    return {name: m.dequantize_weight().t().contiguous()
            for name, m in model.model.named_modules() if hasattr(m, "dequantize_weight")}


# --- autoawq (quant_method awq, GEMM) ----------------------------------------------------------

AWQ = {"awq_4bit_g32": dict(zero_point=True, q_group_size=32, w_bit=4, version="GEMM")}


def make_autoawq(name: str, dense: str, out: str) -> None:
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    model = AutoAWQForCausalLM.from_pretrained(dense)
    tok = AutoTokenizer.from_pretrained(dense)
    calib = [" ".join(f"w{i - 3}" for i in r) for r in calibration_ids()]  # the word-level tokenizer's words
    model.quantize(tok, quant_config=AWQ[name], calib_data=calib, max_calib_seq_len=64, max_calib_samples=16,
                   n_parallel_calib_samples=4)
    model.save_quantized(out)


def dequant_autoawq(out: str) -> dict:
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file

    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    t = load_file(os.path.join(out, "model.safetensors"))
    return {k[: -len(".qweight")]: dequantize_gemm(t[k], t[k.replace("qweight", "qzeros")],
                                                    t[k.replace("qweight", "scales")], qc["bits"],
                                                    qc["group_size"]).t().contiguous()
            for k in t if k.endswith(".qweight")}


TOOLS = {  # tool: (checkpoints, dense dtype, make, dequantize)
    "llmcompressor": (("ct_w4a16_g32_gptq", "ct_w4a16_asym_g64_gptq", "ct_w8a16_gptq", "ct_w8a8_int",
                       "ct_fp8_dynamic", "ct_fp8_static", "ct_fp8_block_w8a16", "ct_awq_w4a16_asym"),
                      torch.bfloat16, make_llmcompressor, dequant_llmcompressor),
    # llm-compressor 0.13.0 / compressed-tensors 0.18.0: the last that writes act-order "group"
    "llmcompressor-0.13": (("ct_w4a16_asym_g64_actorder_group",), torch.bfloat16, make_llmcompressor,
                           dequant_llmcompressor),
    "gptqmodel": (tuple(GPTQ), torch.float16, make_gptqmodel, dequant_gptqmodel),
    "autoawq": (tuple(AWQ), torch.float16, make_autoawq, dequant_autoawq),
}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def make(tool: str, name: str, dense: str) -> None:
    _, _, build, dequantize = TOOLS[tool]
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    build(name, dense, out)
    _tokenizer_files(out, VOCAB)
    ref = {m: {"sha256": digest(w), "dtype": str(w.dtype).replace("torch.", ""), "shape": list(w.shape),
               "sum": float(w.double().sum())} for m, w in sorted(dequantize(out).items())}
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"tool": tool, "dequantized_by": {"llmcompressor": "compressed_tensors decompress",
                                                    "llmcompressor-0.13": "compressed_tensors decompress",
                                                    "gptqmodel": "gptqmodel TorchQuantLinear.dequantize_weight",
                                                    "autoawq": "awq.utils.packing_utils.dequantize_gemm"}[tool],
                   "modules": ref}, f, indent=1, sort_keys=True)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{name}: {len(ref)} quantized modules, {size / 1024:.0f} KiB")


def record_versions(tool: str, cmd: str) -> None:
    """Rewrite this tool's section of VERSIONS.txt: the command and the virtualenv's pip freeze."""
    path = os.path.join(HERE, "VERSIONS.txt")
    sections = {}
    if os.path.exists(path):
        with open(path) as f:
            for block in f.read().split("\n=== ")[1:]:
                head = block.split(" ", 1)[0]
                sections[head] = "=== " + block.rstrip("\n") + "\n"
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], check=True, capture_output=True, text=True).stdout
    sections[tool] = (f"=== {tool} (Python {sys.version.split()[0]}, {', '.join(TOOLS[tool][0])})\n"
                      f"command, from the repository root: {cmd}\n\n{freeze}")
    with open(path, "w") as f:
        f.write("How the checkpoints here were made: one throwaway virtualenv per tool (see "
                "make_tool_checkpoints.py).\n\n" + "\n".join(sections[t] for t in TOOLS if t in sections))


def main(argv: list) -> None:
    if not argv or argv[0] not in TOOLS:
        sys.exit(f"usage: make_tool_checkpoints.py {{{'|'.join(TOOLS)}}} [checkpoint names]")
    tool, names = argv[0], argv[1:] or list(TOOLS[argv[0]][0])
    cmd = " ".join([sys.executable, os.path.relpath(os.path.abspath(__file__), os.getcwd())] + argv)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # gptqmodel writes its logs into the working directory
        try:
            dense = make_checkpoint(os.path.join(tmp, "dense"), "llama", dtype=TOOLS[tool][1], **SHAPES)
            for name in names:
                make(tool, name, dense)
        finally:
            os.chdir(cwd)
    record_versions(tool, cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
