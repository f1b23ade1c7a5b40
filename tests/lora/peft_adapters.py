"""LoRA adapters made locally with PEFT on the tiny random checkpoints (there is no hub), and
HF transformers + PEFT greedy outputs as the reference. A module of its own (not conftest)."""
from __future__ import annotations

import functools
import json
import os

import torch

from checkpoints import hf_model


def make_adapter(base: str, out: str, *, r: int = 8, alpha: float = 16, targets=("q_proj", "k_proj", "v_proj",
                 "o_proj", "gate_proj", "up_proj", "down_proj"), use_rslora: bool = False, seed: int = 0,
                 b_std: float = 0.05) -> str:
    """A PEFT LoRA adapter of ``base`` saved at ``out``, with B drawn non-zero (PEFT starts B at 0,
    which would make every delta vanish)."""
    if os.path.exists(os.path.join(out, "adapter_config.json")):
        return out
    from peft import LoraConfig, get_peft_model

    model = hf_model(base)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    peft_model.save_pretrained(out)
    return out


def edit_config(path: str, **changes) -> None:
    cfg_file = os.path.join(path, "adapter_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)


@functools.lru_cache(maxsize=None)
def hf_peft_greedy(base: str, adapter, prompts: tuple, new: int) -> list[list[int]]:
    """Greedy tokens of HF transformers with ``adapter`` active (None: the base model)."""
    model = hf_model(base)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
        model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([list(p)])
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=new)
            outs.append(g[0, len(p):].tolist())
    return outs
