"""A tiny random-weight LLaVA built locally with transformers (a CLIP vision tower of 2 layers on
16x16 images in 4x4 patches -> 16 features per image, a projector, a 2-layer Llama), its
CLIPImageProcessor config and a word-level tokenizer whose ``<image>`` is one token; and test
images of different sizes and modes."""
from __future__ import annotations

import os

import numpy as np
import torch

VOCAB = 256
IMAGE_TOKEN = VOCAB - 1  # "<image>"
NUM_IMAGE_TOKENS = 16  # (16 / 4) ** 2 patches, the class token dropped ("default" strategy)


def _tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 4)] + ["<image>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   extra_special_tokens={"image_token": "<image>"})
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert fast.convert_tokens_to_ids("<image>") == IMAGE_TOKEN
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(path)


def make_llava_checkpoint(path: str, seed: int = 0) -> str:
    import transformers as tf

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    text = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.1, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=16, patch_size=4, projection_dim=32, initializer_range=0.1)
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                         vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=16)
    model = tf.LlavaForConditionalGeneration(cfg).float()
    with torch.no_grad():  # non-trivial biases and norms, and features large enough to steer the text
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "multi_modal_projector" in name or "vision" in name:
                p.mul_(3.0)
    model.save_pretrained(path, safe_serialization=True)
    tf.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}).save_pretrained(path)
    _tokenizer(path)
    return path


def sample_images():
    """Three PIL images of different sizes and modes (RGB, RGBA with transparency, grayscale)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    a = Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8))
    b = Image.fromarray(rng.integers(0, 256, (40, 24, 4), dtype=np.uint8), "RGBA")
    c = Image.fromarray(rng.integers(0, 256, (17, 17), dtype=np.uint8), "L")
    return [a, b, c]


def hf_llava_greedy(path: str, prompts: list[tuple[list[int], list]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy tokens for (expanded token ids, PIL images) prompts, with HF's own
    image processor making the pixel values."""
    import transformers as tf

    model = tf.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = tf.AutoImageProcessor.from_pretrained(path)
    outs = []
    with torch.no_grad():
        for ids, images in prompts:
            x = torch.tensor([ids])
            kw = {}
            if images:
                kw["pixel_values"] = proc(images=images, return_tensors="pt")["pixel_values"]
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens, **kw)
            outs.append(g[0, len(ids):].tolist())
    return outs
