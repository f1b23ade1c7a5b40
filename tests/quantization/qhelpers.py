"""Shared steps of the quantized-checkpoint tests: a tiny dense Llama to quantize, pagedllm runs,
and the weight comparison against a packer's reference dequantization."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from checkpoints import make_checkpoint  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from prompts import random_prompts  # noqa: E402

PROMPTS = random_prompts((3, 17, 40), seed=5)
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def tiny_llama(ckpt_dir, arch: str = "llama", **kw) -> str:
    """hidden 128, 4 heads / 2 kv heads, intermediate 256: every group size of 32 / 64 divides."""
    args = dict(hidden=128, intermediate=256, heads=4, kv_heads=2, init_std=0.05)
    args.update(kw)
    return make_checkpoint(str(ckpt_dir / f"dense_{arch}"), arch, **args)


def engine(path: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 8 << 20)
    kw.setdefault("dtype", "float32")
    return LLM(model=path, **kw)


def run(llm: LLM, prompts=PROMPTS, sp=SP):
    return llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def model_of(llm: LLM):
    return llm.engine.core.executor.worker.model


def assert_weights_equal(model, ref: dict) -> int:
    """Every quantized linear layer's ``dequantize()`` equals the reference exactly (fused layers:
    their checkpoint modules' rows stacked). Returns how many layers were compared."""
    compared = 0
    for name, module in model.named_modules():
        qw = getattr(module, "quantized", None)
        if qw is None:
            continue
        prefix, leaf = name.rsplit(".", 1)
        parts = [f"{prefix}.{p}" for p in FUSED.get(leaf, (leaf,))]
        expected = torch.cat([ref[p] for p in parts])
        got = qw.dequantize()
        assert torch.equal(got, expected), f"{name}: max diff {(got - expected).abs().max()}"
        compared += 1
    return compared


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def runtime(qw):
    """The QuantizedWeight form of a layer's weight (the CPU kernels keep a repacked copy)."""
    return qw.unpacked() if hasattr(qw, "unpacked") else qw
