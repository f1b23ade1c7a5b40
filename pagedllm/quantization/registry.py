"""Which quantization a checkpoint uses, and which method each of its linear layers gets.

Detection reads ``quantization_config.quant_method`` from config.json; ``EngineConfig.quantization``
overrides it (and ``"int8"`` / ``"fp8"`` on an unquantized checkpoint quantize it at load).
Anything else -- bitsandbytes, GGUF, EXL2, HQQ, ... -- is refused, naming the format.

Per layer, the checkpoint decides: GPTQ / AWQ / FP8 quantize a layer exactly when the checkpoint
holds its quantized tensors (so ``modules_to_not_convert`` / ``ignored_layers`` / per-module
configs are honoured as the tool wrote them); compressed-tensors matches the layer's checkpoint
name against ``config_groups`` targets and the ``ignore`` list, and checks the tensors are there.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from safetensors import safe_open

from pagedllm.config import QUANTIZATION_METHODS
from pagedllm.quantization.awq import AWQMethod, parse_awq_config
from pagedllm.quantization.base import QuantMethod
from pagedllm.quantization.compressed_tensors import CompressedTensorsMethod, scheme_for
from pagedllm.quantization.fp8 import Fp8Method, parse_fp8_config
from pagedllm.quantization.gptq import GPTQMethod, parse_gptq_config
from pagedllm.quantization.online import OnlineMethod

ONLINE = ("int8", "fp8")
SUPPORTED_FORMATS = "gptq (4/8-bit), awq (4-bit gemm), compressed-tensors, fp8; on the fly: int8, fp8"
# Checkpoint tensors that mark a quantized layer (compressed-tensors: its config decides, see method_for).
_MARKERS = {"gptq": ("qweight",), "awq": ("qweight",), "fp8": ("weight_scale", "weight_scale_inv")}
QUANT_SUFFIXES = frozenset(("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_shape",
                            "weight_zero_point", "weight_g_idx", "weight_scale_inv", "input_scale"))


def read_quantization_config(model_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if qc is None and isinstance(raw, dict) and isinstance(raw.get("compression_config"), dict):
        qc = raw["compression_config"]  # older compressed-tensors spelling
    return qc if isinstance(qc, dict) else None


def checkpoint_keys(model_dir: str) -> frozenset:
    """Every tensor name of the checkpoint (the index, or the safetensors headers: no data read)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            return frozenset(json.load(f)["weight_map"])
    keys: set = set()
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                keys.update(f.keys())
    return frozenset(keys)


def _normalise(name: str) -> str:
    name = name.lower().replace("_", "-")
    return {"compressed-tensor": "compressed-tensors", "gptq-marlin": "gptq", "awq-marlin": "awq"}.get(name, name)


@dataclass
class QuantizationConfig:
    """The checkpoint's (or requested) quantization: ``name`` and the parsed settings."""

    name: str
    raw: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    keys: frozenset = frozenset()

    @property
    def online(self) -> bool:
        return self.name in ONLINE and not self.raw

    def method_for(self, layer_name: str, parts: list[str]) -> Optional[QuantMethod]:
        """The method of one of our linear layers whose checkpoint modules are ``parts`` (several for
        fused q/k/v or gate/up); None leaves it dense. Raises when the parts disagree."""
        if self.online:
            return OnlineMethod(self.name)
        if self.name == "compressed-tensors":
            schemes = {p: scheme_for(self.raw, p) for p in parts}
            chosen = set(schemes.values())
            if len(chosen) > 1:
                raise ValueError(f"{layer_name}: its checkpoint modules {parts} have different compressed-tensors "
                                 f"schemes (pagedllm fuses them into one layer)")
            scheme = chosen.pop()
            marker = ("weight_packed" if scheme.fmt == "pack" else "weight_scale") if scheme else None
            if scheme is not None and not all(f"{p}.{marker}" in self.keys for p in parts):
                raise ValueError(f"{layer_name}: the config quantizes {parts} but the checkpoint has no "
                                 f"'{parts[0]}.{marker}'")
            return CompressedTensorsMethod(scheme) if scheme is not None else None
        present = [any(f"{p}.{m}" in self.keys for m in _MARKERS[self.name]) for p in parts]
        if not any(present):
            return None
        if not all(present):
            raise ValueError(f"{layer_name}: only some of its checkpoint modules {parts} are {self.name}-quantized "
                             "(pagedllm fuses them into one layer)")
        s = self.settings
        if self.name == "gptq":
            return GPTQMethod(s["bits"], s["group_size"], s["desc_act"], s["v2"], s["sym"],
                              has_g_idx=all(f"{p}.g_idx" in self.keys for p in parts))
        if self.name == "awq":
            return AWQMethod(s["group_size"])
        return Fp8Method(s["static"], s["block"])


def resolve_quantization(model_dir: str, requested: Optional[str]) -> Optional[QuantizationConfig]:
    """The quantization to load ``model_dir`` with (None: a dense model); raises for unsupported
    formats and for a request that contradicts the checkpoint."""
    qc = read_quantization_config(model_dir)
    detected = _normalise(str(qc.get("quant_method", ""))) if qc else None
    if qc is not None and not detected:
        raise ValueError("config.json has a quantization_config without quant_method; supported: " + SUPPORTED_FORMATS)
    want = _normalise(requested) if requested else None
    if want is not None and want not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {requested!r} is not supported; supported: {SUPPORTED_FORMATS}")
    if want == "gguf":  # the quantization of GGUF files (models/gguf.py), which never come here
        raise ValueError(f"quantization='gguf' is for GGUF files; {model_dir} is a checkpoint folder (leave "
                         "quantization unset, or pass the .gguf file as the model)")
    if detected is None:
        if want is None:
            return None
        if want not in ONLINE:
            raise ValueError(f"quantization={requested!r} was requested but {model_dir} has no quantization_config "
                             f"in config.json (an unquantized checkpoint can be quantized at load with int8 or fp8)")
        return QuantizationConfig(want)
    if detected not in QUANTIZATION_METHODS or detected in ("int8", "gguf"):
        raise ValueError(f"the checkpoint is quantized with {detected!r}, which pagedllm does not support; "
                         f"supported: {SUPPORTED_FORMATS}")
    if want is not None and want != detected:
        raise ValueError(f"quantization={requested!r} was requested but the checkpoint is quantized with "
                         f"{detected!r} (its config.json quantization_config)")
    parse = {"gptq": parse_gptq_config, "awq": parse_awq_config, "fp8": parse_fp8_config}.get(detected)
    if detected == "compressed-tensors":
        status = qc.get("quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise ValueError(f"compressed-tensors checkpoint with quantization_status {status!r} is not supported "
                             "(supported: compressed)")
        if qc.get("sparsity_config"):
            raise ValueError("compressed-tensors checkpoints with a sparsity_config are not supported")
    return QuantizationConfig(detected, qc, parse(qc) if parse else {}, checkpoint_keys(model_dir))
