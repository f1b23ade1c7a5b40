"""A tokenizer over ``tokenizers`` + ``jinja2`` alone, without importing transformers (seconds of
start-up: it drags in torch.distributed.tensor and sympy).

It covers what pagedllm uses of a Hugging Face fast tokenizer -- encode, decode, special token
ids, the chat template -- and only loads checkpoints whose tokenizer is the generic fast one
(``tokenizer.json`` with tokenizer_class PreTrainedTokenizerFast / TokenizersBackend), where the
transformers behaviour is exactly the Rust tokenizer's plus the rules reproduced here (BOS/EOS
template from add_bos_token/add_eos_token, chat rendering with the same sandbox, filters and
globals, then encoding without special tokens). Anything else -- other tokenizer classes,
add_bos_token / add_eos_token set, clean-up of tokenization spaces, tokens only listed in
tokenizer_config.json -- returns None: the caller falls back to ``AutoTokenizer``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from pagedllm.tokenizer.chat_template import render_bounded

_GENERIC = {"PreTrainedTokenizerFast", "TokenizersBackend"}
_LONG_TEXT = 4096
_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _content(tok) -> Optional[str]:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


class LightTokenizer:
    def __init__(self, path: str, backend, config: dict, special: dict, chat_template: Optional[str]) -> None:
        self.name_or_path = path
        self._tokenizer = backend
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = False
        self._special = special
        for attr in _SPECIAL_ATTRS:
            setattr(self, attr, special.get(attr))
        self.additional_special_tokens = list(special.get("additional_special_tokens") or [])
        self.model_max_length = config.get("model_max_length")
        names = [t for t in (special.get(a) for a in _SPECIAL_ATTRS) if t] + self.additional_special_tokens
        self.all_special_tokens = list(dict.fromkeys(names))
        self.all_special_ids = [i for i in (backend.token_to_id(t) for t in self.all_special_tokens) if i is not None]
        self.vocab_size = backend.get_vocab_size(with_added_tokens=False)

    @property
    def backend_tokenizer(self):
        """The ``tokenizers.Tokenizer`` underneath (a transformers fast tokenizer's name for it)."""
        return self._tokenizer

    # ---- ids of special tokens --------------------------------------------------------------
    def _id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self._id(self.eos_token)

    @property
    def unk_token_id(self) -> Optional[int]:
        return self._id(self.unk_token)

    @property
    def pad_token_id(self) -> Optional[int]:
        return self._id(self.pad_token)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            tid = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._tokenizer.id_to_token(i) for i in ids if i not in special]

    # ---- text <-> ids -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if len(text) > _LONG_TEXT:  # encode_batch releases the GIL (encode does not): other threads run
            return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, chat_template: Optional[str] = None, tools=None, documents=None,
                            **kwargs):
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        variables = {a: getattr(self, a) for a in _SPECIAL_ATTRS}
        variables["additional_special_tokens"] = self.additional_special_tokens
        variables.update(kwargs)
        text = render_bounded(template, dict(messages=[dict(m) for m in conversation], tools=tools, documents=documents,
                                             add_generation_prompt=add_generation_prompt, **variables))
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=False)


def load_light_tokenizer(path: str) -> Optional[LightTokenizer]:
    """The tokenizer at ``path`` if it is a plain ``tokenizer.json`` one, else None."""
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        return None
    try:
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
    except (OSError, ValueError):
        return None
    if config.get("tokenizer_class") not in _GENERIC:
        return None
    if config.get("clean_up_tokenization_spaces") or config.get("split_special_tokens") or config.get("auto_map"):
        return None
    from tokenizers import Tokenizer, processors

    try:
        backend = Tokenizer.from_file(tok_file)
    except Exception:
        return None
    added = {t["content"]: t["id"] for t in json.load(open(tok_file, encoding="utf-8")).get("added_tokens", [])}
    for tid, tok in (config.get("added_tokens_decoder") or {}).items():
        if added.get(_content(tok)) != int(tid):
            return None  # tokens only transformers knows about
    special: dict[str, Any] = {}
    for attr in _SPECIAL_ATTRS:
        value = _content(config.get(attr)) or _content(special_map.get(attr))
        if value is not None:
            special[attr] = value
    extra = config.get("additional_special_tokens") or special_map.get("additional_special_tokens") or []
    special["additional_special_tokens"] = [c for c in (_content(t) for t in extra) if c]
    named = [v for k, v in special.items() if k != "additional_special_tokens"]
    for name in named + special["additional_special_tokens"]:
        if backend.token_to_id(name) is None:
            return None
    if config.get("add_bos_token") or config.get("add_eos_token"):
        return None  # transformers' own BOS/EOS template rules apply: let it decide
    if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
        # what transformers installs when both flags are off: no special tokens around the text
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    chat_template = config.get("chat_template")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            chat_template = f.read()
    if isinstance(chat_template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default")
    return LightTokenizer(path, backend, config, special, chat_template)
