"""scripts/train_eagle_head.py end to end on a slice of the corpus: a few steps write an EAGLE-1
checkpoint (no embed_tokens: the target's is shared) that the engine loads as a head."""
import importlib.util
import json
import os

from pagedllm import LLM, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_training_script_writes_a_loadable_head(tmp_path):
    path = os.path.join(REPO, "scripts", "train_eagle_head.py")
    spec = importlib.util.spec_from_file_location("train_eagle_head", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with open(os.path.join(REPO, "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        (tmp_path / "corpus.txt").write_text(f.read(20000))
    out = tmp_path / "head"
    assert script.main(["--data", str(tmp_path / "corpus.txt"), "--out", str(out), "--max-steps", "3",
                        "--feature-windows", "4", "--batch-size", "2", "--seq-len", "32", "--threads", "1"]) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 3 and 0 <= summary["val_top1_agreement"] <= 1
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "embed_tokens.weight" not in names
    assert not any("input_layernorm" in n for n in names)  # EAGLE-1: the first layer has none

    prompts = ["ROMEO:\n"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = LLM(kv_cache_memory=16 << 20).generate(prompts, sp, use_tqdm=False)
    llm = LLM(kv_cache_memory=16 << 20, speculative_config={"method": "eagle", "model": str(out),
                                                             "num_speculative_tokens": 2, "auto_disable": False})
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == base[0].outputs[0].token_ids
    assert llm.get_stats().spec_num_drafts > 0
