"""Quantized linear layers for any model family, without touching the model files.

The worker builds the model with dense linear weights on the meta device
(``linear_weights_on_meta``), then :func:`quantize_linear_layers` walks its linear modules: each
gets its quantization method's checkpoint-shaped parameters (``create_weights``, with this rank's
tensor-parallel partition) or, where the checkpoint leaves it dense, a real dense weight. So no
dense weight is ever allocated for a quantized layer. After loading, :func:`finish_quantized_layers`
unpacks every layer into its run-time :class:`QuantizedWeight`, and on CPU, once the C++ kernels
are loaded, :func:`prepare_quantized_layers` repacks it for them.

Our fused layers (qkv_proj, gate_up_proj) are matched to their checkpoint modules (q/k/v_proj,
gate/up_proj) through the loader's own name mapping, so ignore lists and per-module presence
are judged on the names the quantization tool saw. Stays dense: the embedding and LM head, MoE
routers and experts (a checkpoint with quantized experts is refused), and MLA's ``kv_b_proj``
(its weight is read directly for the absorbed attention).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Optional

import torch
from torch import nn

from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.models.loader import checkpoint_target
from pagedllm.quantization.base import LinearPartition, install_quantized
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.quantization.gguf import GGUFWeight, install_gguf, pack_vocab_table, tie_packed_head
from pagedllm.quantization.qgemm import prepare
from pagedllm.quantization.quantized_weight import QuantizedWeight
from pagedllm.quantization.registry import QUANT_SUFFIXES, SUPPORTED_FORMATS, QuantizationConfig

logger = logging.getLogger(__name__)

LINEAR_TYPES = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)
KEEP_DENSE = ("kv_b_proj",)  # MLA multiplies with slices of this weight itself


def partition(module: nn.Module) -> LinearPartition:
    """A linear layer's tensor-parallel part, as its own dense weight_loader slices the checkpoint."""
    n, k = module.weight.shape
    if isinstance(module, RowParallelLinear):
        rank, size = module.tp.rank, module.tp.world_size
        return LinearPartition(k, k * size, rank * k, n, ((None, 0, n, 0),))
    if isinstance(module, QKVParallelLinear):
        q, kv = module.output_sizes[0], module.output_sizes[1]
        kv_start = (module.tp_rank // module.kv_replicas) * kv
        shards = (("q", 0, q, module.tp_rank * q), ("k", q, kv, kv_start), ("v", q + kv, kv, kv_start))
        return LinearPartition(k, k, 0, n, shards)
    if isinstance(module, ColumnParallelLinear):
        shards, offset = [], 0
        for i, size in enumerate(module.output_sizes):
            shards.append((i, offset, size, module.tp_rank * size))
            offset += size
        shards.append((None, 0, n, module.tp_rank * n))
        return LinearPartition(k, k, 0, n, tuple(shards))
    return LinearPartition(k, k, 0, n, ((None, 0, n, 0),))


def _checkpoint_modules(model: nn.Module, keys) -> dict[str, list[str]]:
    """Our module name -> the checkpoint module names whose tensors load into it."""
    mapping = getattr(model, "packed_modules_mapping", {})
    remap = getattr(model, "remap_checkpoint_name", None)
    found: dict[str, set] = defaultdict(set)
    for key in keys:
        if "." not in key:
            continue
        target, _ = checkpoint_target(key, mapping, remap)
        found[target.rsplit(".", 1)[0]].add(key.rsplit(".", 1)[0])
    return {k: sorted(v) for k, v in found.items()}


def _refuse_unsupported(model: nn.Module, qc: QuantizationConfig) -> None:
    if qc.online or qc.name == "gguf":  # GGUF: every family's linear layers, checked per tensor type
        return
    family = type(model).__name__
    if getattr(model, "checkpoint_tensors", None) is not None:
        raise ValueError(f"{qc.name} checkpoints of {family} are not supported (its checkpoint tensors are renamed or "
                         "split at load); quantization='int8' or 'fp8' on its unquantized checkpoint is")
    for key in qc.keys:
        suffix = key.rsplit(".", 1)[-1]
        if suffix not in QUANT_SUFFIXES:
            continue
        if ".experts." in key:
            raise ValueError(f"{family}: this {qc.name} checkpoint quantizes the MoE experts ({key!r}); pagedllm keeps "
                             "MoE experts unquantized and cannot load quantized ones (a checkpoint that leaves the "
                             "experts dense, e.g. listed in its ignore list, loads)")
        if key.startswith("lm_head.") or ".embed_tokens." in key:
            raise ValueError(f"{family}: this {qc.name} checkpoint quantizes {key.rsplit('.', 1)[0]!r}; the embedding "
                             "and LM head stay unquantized in pagedllm (supported: quantized linear layers)")


def quantize_linear_layers(model: nn.Module, qc: Optional[QuantizationConfig]) -> int:
    """Give every linear layer of a model built under ``linear_weights_on_meta`` its quantized
    parameters or a real dense weight; returns how many layers are quantized. Call inside the
    device / default-dtype context the model was built in."""
    if qc is None:
        return 0
    _refuse_unsupported(model, qc)
    parts = {} if qc.online else _checkpoint_modules(model, qc.keys)
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, LINEAR_TYPES):
            continue
        method = qc.method_for(name, parts.get(name) or [name])
        if method is not None and name.rsplit(".", 1)[-1] in KEEP_DENSE:
            if not qc.online:
                raise ValueError(f"{name}: a quantized {name.rsplit('.', 1)[-1]} is not supported (multi-head latent "
                                 f"attention reads its weight directly); supported formats: {SUPPORTED_FORMATS}")
            method = None
        dense = module.weight
        if method is None:
            if dense.is_meta:
                real = nn.Parameter(torch.empty(dense.shape), requires_grad=False)
                real.weight_loader = dense.weight_loader  # type: ignore[attr-defined]
                module.weight = real
            continue
        part = partition(module)
        del module._parameters["weight"]
        method.create_weights(module, part, name)
        module.quant_method = method
        module.packable_weight = False  # the CPU GEMM packing (layers/cpu_gemm.py) leaves it alone
        module.dense_bytes = part.out_features * part.in_features * torch.empty((), dtype=dense.dtype).element_size()
        count += 1
    if count == 0 and not qc.online and getattr(qc, "require_match", True):
        raise ValueError(f"quantization {qc.name}: no linear layer of {type(model).__name__} matched the checkpoint's "
                         "quantized tensors")
    return count


def pack_gguf_vocab_tables(model: nn.Module, qc) -> int:
    """A GGUF file's embeddings / LM heads stored quantized keep their rows packed (before
    loading; call where the model is built, in its dtype)."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding) and qc.types.get(f"{name}.weight", "F32") != "F32":
            pack_vocab_table(module, name)
            count += 1
    return count


def finish_quantized_layers(model: nn.Module) -> None:
    """After loading: every quantized layer unpacked into its run-time form; logs the bytes."""
    tie_packed_head(model)
    layers = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
    if not layers:
        return
    for m in layers:
        m.quant_method.process_after_loading(m)
    quantized = sum(m.quantized.nbytes() for m in layers)
    dense = sum(m.dense_bytes for m in layers)
    kinds = sorted({f"{m.quantized.kind}{'/' + m.quantized.act_quant if m.quantized.act_quant else ''}"
                    for m in layers})
    logger.info("quantization %s: %d linear layers (%s), their weights %.1f MiB instead of %.1f MiB dense (%.2fx "
                "smaller)", layers[0].quant_method.name, len(layers), ", ".join(kinds), quantized / 2**20,
                dense / 2**20, dense / max(quantized, 1))


def prepare_quantized_layers(model: nn.Module) -> int:
    """After the CPU kernels are loaded: every quantized weight repacked once into the layout they
    multiply (``qgemm.prepare``; the unpacked form is dropped). Returns how many were repacked."""
    count = 0
    kernels = cpu_kernels.ready()
    for m in model.modules():
        qw = getattr(m, "quantized", None)
        if isinstance(qw, GGUFWeight):  # GGUF blocks: into panels where the type has a panel form
            panels = qw.with_panels(kernels) if kernels is not None else qw
            if panels is not qw:
                install_gguf(m, panels)
                count += 1
            continue
        if not isinstance(qw, QuantizedWeight):
            continue
        packed = prepare(qw)
        if packed is not qw:
            install_quantized(m, packed)
            count += 1
    return count + prepare_gguf_vocab_tables(model, kernels)


def prepare_gguf_vocab_tables(model: nn.Module, kernels) -> int:
    """A GGUF embedding table (and the tied head that multiplies it) into panels, once; the
    modules' ``weight`` becomes the panels' bytes (one parameter shared by both)."""
    if kernels is None:
        return 0
    done: dict = {}
    for m in model.modules():
        gw = getattr(m, "packed", None)
        if not isinstance(gw, GGUFWeight):
            continue
        if id(gw) not in done:
            new = gw.with_panels(kernels)
            params = None
            if new is not gw:
                pw = new.segments[0].panels
                params = tuple(None if t is None else nn.Parameter(t, requires_grad=False)
                               for t in (pw.packed, pw.scales, pw.zeros))
            done[id(gw)] = (new, params)
        new, params = done[id(gw)]
        if params is not None:
            m.packed = new
            m.weight, m.packed_scales = params[0], params[1]
            if params[2] is not None:
                m.packed_zeros = params[2]
    return sum(1 for _, params in done.values() if params is not None)
