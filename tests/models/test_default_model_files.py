"""Checks of the shipped default model directory ``models/tiny-shakespeare`` (no training).

The directory is produced by ``scripts/train_default_model.py``; these tests only make sure
that what is committed is a complete, standard Hugging Face model that loads offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare"

REQUIRED_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
]

ROUND_TRIP_TEXTS = [
    "ROMEO:\nO, she doth teach the torches to burn bright!\n",
    "  leading spaces,\ttabs\tand   runs of spaces  \n\n\nblank lines\r\nand CRLF\n",
    " x",
    "",
    "Unicode: café naïve — “quotes” 日本語 😀 Ω≈ç√\n",
    "<s> literal specials </s> in text <pad>",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    m.eval()
    return m


def test_model_dir_complete_and_small():
    assert MODEL_DIR.is_dir(), f"{MODEL_DIR} is missing; run scripts/train_default_model.py"
    for name in REQUIRED_FILES:
        assert (MODEL_DIR / name).is_file(), f"missing {name}"
    total = sum(f.stat().st_size for f in MODEL_DIR.rglob("*") if f.is_file())
    assert total < 30 * 1024 * 1024, f"model dir is {total / 1e6:.1f} MB"
    # model card states how it was trained and what it scores
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    assert "scripts/train_default_model.py" in card
    assert "nats" in card and "ROMEO:" in card


def test_config_special_token_ids(tokenizer):
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["vocab_size"] == len(tokenizer)
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert cfg["bos_token_id"] == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<s>")
    assert cfg["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("</s>")
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # byte-level BPE: every piece of text is representable without an unknown token
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids


def test_tokenizer_specials_and_no_implicit_bos(tokenizer):
    ids = tokenizer("ROMEO:").input_ids
    assert tokenizer.decode(ids) == "ROMEO:"
    assert tokenizer.bos_token_id not in ids and tokenizer.eos_token_id not in ids
    # special tokens written in text are parsed as the special tokens
    assert tokenizer.encode("<s>", add_special_tokens=False) == [tokenizer.bos_token_id]


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "A street in Verona."},
        {"role": "user", "content": "Who goes there?"},
        {"role": "assistant", "content": "A friend."},
        {"role": "user", "content": "Speak, then."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "A street in Verona.\n\n"
        "USER:\nWho goes there?\n\n"
        "ASSISTANT:\nA friend.\n\n"
        "USER:\nSpeak, then.\n\n"
        "ASSISTANT:\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text[: -len("ASSISTANT:\n")]
    named = tokenizer.apply_chat_template(
        [{"role": "user", "name": "Romeo", "content": "Hark!"}], tokenize=False, add_generation_prompt=True)
    assert named == "ROMEO:\nHark!\n\nASSISTANT:\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    assert tokenizer.decode(ids) == text


def test_model_forward(model, tokenizer):
    import torch

    ids = torch.tensor([tokenizer.encode("ROMEO:\nO, she doth teach", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n_params < 10_000_000
