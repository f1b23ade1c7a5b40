"""LoRA adapters over a quantized base model (QLoRA-style serving): the base's linear layers run
their quantized matmul (GPTQ 4-bit, compressed-tensors W8A16 int) and the adapter's delta is added
in the model dtype. Reference: HF transformers + PEFT with the same adapter over the dense model
holding the base's dequantized weights (the packer writes it beside the checkpoint), greedy, with
base rows and adapter rows mixed in one batch."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "quantization"))

from packers import ct_config, gptq_config, quantize_checkpoint  # noqa: E402
from peft_adapters import hf_peft_greedy, make_adapter  # noqa: E402
from prompts import random_prompts  # noqa: E402
from qhelpers import model_of, tiny_llama  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.lora.request import LoRARequest  # noqa: E402

NEW = 12
PROMPTS = tuple(tuple(p) for p in random_prompts((3, 17, 40), seed=5))
FORMATS = {
    "gptq_4bit_g32": ("gptq", lambda: gptq_config(bits=4, group_size=32), dict(bits=4, group_size=32)),
    "ct_w8a16_channel": ("ct-int", lambda: ct_config("int-quantized", {"num_bits": 8, "strategy": "channel"}), {}),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_adapter_over_quantized_base_matches_peft_over_its_dequantized_weights(tmp_path_factory, fmt):
    d = tmp_path_factory.mktemp(f"qlora_{fmt}")
    kind, qconfig, opts = FORMATS[fmt]
    path = str(d / "quantized")
    quantize_checkpoint(tiny_llama(d), path, kind, qconfig(), **opts)
    dense = path + "-dequant"
    adapter = make_adapter(dense, str(d / "adapter"), r=8, alpha=16, seed=1)
    want_lora = hf_peft_greedy(dense, adapter, PROMPTS, NEW)
    want_base = hf_peft_greedy(dense, None, PROMPTS, NEW)

    llm = LLM(model=path, dtype="float32", kv_cache_memory=8 << 20, enable_lora=True, max_lora_rank=8)
    assert any(getattr(m, "quantized", None) is not None for m in model_of(llm).modules()), "base not quantized"
    items = [list(p) for p in PROMPTS] * 2
    reqs = [LoRARequest("a", 1, adapter)] * len(PROMPTS) + [None] * len(PROMPTS)
    outs = llm.generate(prompt_token_ids=items, sampling_params=SamplingParams(temperature=0, max_tokens=NEW,
                                                                                ignore_eos=True),
                        lora_request=reqs, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[:len(PROMPTS)] == want_lora
    assert got[len(PROMPTS):] == want_base
    assert want_lora != want_base  # the adapter matters
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.engine.shutdown()
