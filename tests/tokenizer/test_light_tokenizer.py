"""The transformers-free tokenizer behaves exactly like AutoTokenizer where it is used, and steps
aside (None) where it cannot promise that."""
from __future__ import annotations

import json
import os
import random
import shutil


from pagedllm.tokenizer.light_tokenizer import load_light_tokenizer

TEXTS = ["w1 w2 hello", "", " x", "ROMEO:\nO, she doth teach the torches to burn bright!\n",
         "  leading\tspaces  \n\n", "Unicode: café — “q” 日本語 😀", "<s> literal </s> <pad> <unk>",
         "w5##w6 w7"]
MESSAGES = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "w1 hi"},
            {"role": "assistant", "content": "w3"}, {"role": "user", "content": "w9", "name": "bob"}]


def assert_same(path: str) -> None:
    from transformers import AutoTokenizer

    hf, light = AutoTokenizer.from_pretrained(path), load_light_tokenizer(path)
    assert light is not None
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "all_special_ids", "bos_token",
                 "eos_token", "chat_template"):
        assert getattr(hf, attr) == getattr(light, attr), attr
    assert len(hf) == len(light)
    for text in TEXTS:
        for special in (True, False):
            assert hf.encode(text, add_special_tokens=special) == light.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == light.decode(ids, skip_special_tokens=skip), ids
    if hf.chat_template:
        for gen in (True, False):
            text = hf.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
            assert text == light.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
            ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert list(ids) == light.apply_chat_template(MESSAGES, add_generation_prompt=gen)


def test_matches_autotokenizer_on_test_checkpoint(llama_ckpt):
    assert_same(llama_ckpt)


def test_matches_autotokenizer_on_default_model(default_model):
    assert_same(default_model)


def test_add_bos_eos_flags(llama_ckpt, tmp_path):
    path = str(tmp_path / "tok")
    shutil.copytree(llama_ckpt, path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "add_bos_token": False, "add_eos_token": False}, open(cfg_path, "w"))
    assert_same(path)
    for flags in ({"add_bos_token": True}, {"add_eos_token": True}):
        json.dump({**cfg, **flags}, open(cfg_path, "w"))
        assert load_light_tokenizer(path) is None, flags  # transformers' rules apply


def test_steps_aside_when_unsure(llama_ckpt, tmp_path):
    path = str(tmp_path / "tok")
    shutil.copytree(llama_ckpt, path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    for change in ({"tokenizer_class": "LlamaTokenizer"}, {"clean_up_tokenization_spaces": True},
                   {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}):
        json.dump({**cfg, **change}, open(cfg_path, "w"))
        assert load_light_tokenizer(path) is None, change
    os.remove(os.path.join(path, "tokenizer.json"))
    assert load_light_tokenizer(path) is None


def test_load_tokenizer_uses_it(llama_ckpt):
    from pagedllm.tokenizer.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(llama_ckpt)
    assert type(tok).__name__ == "LightTokenizer"
    assert apply_chat_template(tok, [{"role": "user", "content": "w1"}]) == tok.encode("user: w1 assistant:")
