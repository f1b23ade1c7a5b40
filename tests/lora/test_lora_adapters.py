"""Bad adapters are refused at load with the reason (the engine goes on serving), adapters are
added and removed while requests run, and the worker's host cache and slots swap adapters."""
import json
import os
import shutil

import pytest
import torch

from checkpoints import make_checkpoint
from peft_adapters import edit_config, hf_peft_greedy, make_adapter
from prompts import random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.request import LoRARequest

NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PROMPTS = tuple(tuple(p) for p in random_prompts((9, 21), seed=5))


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_bad")
    base = make_checkpoint(str(d / "base"), "llama")
    good = make_adapter(base, str(d / "good"), r=8, seed=4)
    other = make_adapter(base, str(d / "other"), r=4, targets=("o_proj", "down_proj"), seed=5)
    wide = make_checkpoint(str(d / "wide"), "llama", hidden=96, heads=4, kv_heads=2)
    mismatched = make_adapter(wide, str(d / "mismatched"), r=4, seed=6)  # made for another hidden size
    return d, base, good, other, mismatched


def broken(d, good, name, change):
    path = str(d / name)
    if not os.path.exists(path):
        shutil.copytree(good, path)
        change(path)
    return path


BAD_CASES = {
    "rank_above_max": (lambda p: edit_config(p, r=32), "rank r=32 is above max_lora_rank=8"),
    "unknown_target": (lambda p: edit_config(p, target_modules=["q_proj", "lm_head"]),
                       r"target modules \['lm_head'\] are not supported"),
    "modules_to_save": (lambda p: edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    "dora": (lambda p: edit_config(p, use_dora=True), "use_dora"),
    "missing_weights": (lambda p: os.remove(os.path.join(p, "adapter_model.safetensors")),
                        "has no adapter_model.safetensors"),
    "missing_config": (lambda p: os.remove(os.path.join(p, "adapter_config.json")), "has no adapter_config.json"),
    "not_json": (lambda p: open(os.path.join(p, "adapter_config.json"), "w").write("{"), "not readable JSON"),
    "nested_too_deeply": (lambda p: open(os.path.join(p, "adapter_config.json"), "w").write(
        '{"a":' * 100000 + "1" + "}" * 100000), "nests too deeply"),
    # NaN/inf would load and silently spoil every output (issue 29)
    "inf_alpha": (lambda p: edit_config(p, lora_alpha=float("inf")), "lora_alpha must be a finite number"),
    "nan_alpha": (lambda p: edit_config(p, lora_alpha=float("nan")), "lora_alpha must be a finite number"),
    "overflowing_alpha": (lambda p: edit_config(p, lora_alpha=1e300), r"lora_B x scaling holds non-finite values"),
    "nan_weight": (lambda p: poison_weights(p, "lora_A", float("nan")), r"lora_A holds non-finite values"),
    "inf_weight": (lambda p: poison_weights(p, "lora_B", float("-inf")), r"lora_B x scaling holds non-finite values"),
}


def poison_weights(path: str, which: str, value: float) -> None:
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(f)
    key = sorted(k for k in tensors if which in k)[3]
    tensors[key].view(-1)[7] = value
    save_file(tensors, f)


def test_bad_adapters_are_refused_and_the_engine_goes_on(base_and_adapters):
    d, base, good, _, mismatched = base_and_adapters
    llm = LLM(model=base, dtype="float32", kv_cache_memory=8 << 20, enable_lora=True, max_loras=2, max_lora_rank=8)
    for name, (change, message) in BAD_CASES.items():
        path = broken(d, good, name, change)
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest(name, 1, path), use_tqdm=False)
    with pytest.raises(ValueError, match=r"layer 0 down_proj has lora_A \(4, 128\) and lora_B \(96, 4\); the base model needs \(4, 128\) and \(64, 4\)"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("mismatched", 1, mismatched), use_tqdm=False)
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("nowhere", 1, str(d / "nowhere")), use_tqdm=False)
    # nothing was queued, nothing leaked, and a good adapter still runs
    out = llm.generate([list(PROMPTS[0])], GREEDY, lora_request=LoRARequest("good", 1, good), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_peft_greedy(base, good, PROMPTS, NEW)[0]
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_unsupported_model_refused(tmp_path):
    from pagedllm.lora.peft_adapter import ModelLoRALayout

    class Cfg:
        model_type = "gpt2"

    with pytest.raises(ValueError, match="LoRA adapters are supported on llama, mistral, qwen2, qwen3"):
        ModelLoRALayout.from_hf_config(Cfg())


def test_add_and_remove_adapters_while_requests_run(base_and_adapters):
    """Requests of adapter A run while B is added and A removed: A's running requests finish
    with A; new requests for A are refused... by name only in the server (the engine takes a
    LoRARequest with its path), so here A comes back under a new path and is a new adapter."""
    _, base, good, other, _ = base_and_adapters
    engine = LLMEngine(__import__("pagedllm.config", fromlist=["EngineConfig"]).EngineConfig(
        model=base, dtype="float32", kv_cache_memory=8 << 20, enable_lora=True, max_loras=1, max_lora_rank=8,
        max_cpu_loras=1))
    a, b = LoRARequest("a", 1, good), LoRARequest("b", 2, other)
    engine.lora_registry.add(a)
    engine.add_request("a0", list(PROMPTS[0]), GREEDY, lora_request=a)
    engine.add_request("base0", list(PROMPTS[1]), GREEDY)
    engine.step()
    engine.step()
    engine.lora_registry.add(b)
    engine.add_request("b0", list(PROMPTS[1]), GREEDY, lora_request=b)  # waits: the one slot is A's
    assert engine.lora_registry.remove("a")
    assert engine.lora_registry.get("a") is None and engine.lora_registry.get("b") == b
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert results["a0"] == hf_peft_greedy(base, good, PROMPTS, NEW)[0]
    assert results["b0"] == hf_peft_greedy(base, other, PROMPTS, NEW)[1]
    assert results["base0"] == hf_peft_greedy(base, None, PROMPTS, NEW)[1]
    worker = engine.core.executor.worker
    assert worker.lora.num_disk_loads == 2 and list(worker.lora.cpu_cache) == [engine.resolve_lora(b).key]
    with pytest.raises(ValueError, match="already loaded"):
        engine.lora_registry.add(b)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.running_loras == ()


def test_slot_tensors_hold_the_scaled_adapter(base_and_adapters):
    """What the worker put in a slot: A, and B times alpha / r, at each target's offsets."""
    _, base, good, _, _ = base_and_adapters
    llm = LLM(model=base, dtype="float32", kv_cache_memory=8 << 20, enable_lora=True, max_loras=2, max_lora_rank=8)
    llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("good", 1, good), use_tqdm=False)
    from safetensors.torch import load_file

    weights = load_file(os.path.join(good, "adapter_model.safetensors"))
    cfg = json.load(open(os.path.join(good, "adapter_config.json")))
    scale = cfg["lora_alpha"] / cfg["r"]
    layer = llm.engine.core.executor.worker.lora.layers[(1, "qkv_proj")]
    slot = llm.engine.core.scheduler.lora_slots.slot_of[llm.engine.resolve_lora(LoRARequest("good", 1, good)).key]
    key = "base_model.model.model.layers.1.self_attn.{}_proj.lora_{}.weight"
    r = cfg["r"]
    for j, t in enumerate("qkv"):
        torch.testing.assert_close(layer.lora_a[slot, j * r:(j + 1) * r], weights[key.format(t, "A")])
        lo, size = layer.offsets[j], layer.out_sizes[j]
        torch.testing.assert_close(layer.lora_b[slot, lo:lo + size, j * r:(j + 1) * r], weights[key.format(t, "B")] * scale)
        assert not layer.lora_b[slot, :lo, j * r:(j + 1) * r].any() and not layer.lora_b[slot, lo + size:, j * r:(j + 1) * r].any()


@pytest.mark.parametrize("name, message", [
    ("a\nb", "control, format or separator"), ("tab\there", "control"), ("zero\u200bwidth", "format"),
    ("x" * 10_000, "over the limit of 256"), ("", "non-empty"),
])
def test_bad_lora_names_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(name, 1, "/some/where")


def test_the_adapter_registry_is_bounded(base_and_adapters):
    from pagedllm.lora.registry import LoRARegistry
    from pagedllm.models.config_json import load_hf_config

    _, base, good, other, _ = base_and_adapters
    reg = LoRARegistry(load_hf_config(base), 8, max_adapters=2)
    reg.add(LoRARequest("one", 1, good))
    reg.add(LoRARequest("two", 2, other))
    with pytest.raises(ValueError, match="max_registered_loras"):
        reg.add(LoRARequest("three", 3, good))
    reg.resolve(LoRARequest("one", 1, good))  # a known name is no new entry
    assert reg.remove("one")
    reg.add(LoRARequest("three", 3, good))
    assert sorted(r.lora_name for r in reg.requests()) == ["three", "two"]
