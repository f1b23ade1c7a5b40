"""Tokenizer loading (HF, local files only) and chat-template rendering."""
from __future__ import annotations

from typing import Any, Optional


def load_tokenizer(path: str):
    from pagedllm.tokenizer.light_tokenizer import load_light_tokenizer

    light = load_light_tokenizer(path)  # plain tokenizer.json: no transformers import (seconds)
    if light is not None:
        return light
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # surface a clear message; no network fallback
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        chat_template: Optional[str] = None, **kwargs) -> list[int]:
    """The token ids of the conversation rendered by the chat template."""
    return render_chat_prompt(tokenizer, messages, add_generation_prompt, chat_template, **kwargs)[1]


def render_chat_prompt(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                       chat_template: Optional[str] = None, **kwargs) -> tuple[str, list[int]]:
    """(the rendered prompt, its token ids): the template's text, tokenised without special tokens
    unless ``add_special_tokens`` (as transformers' ``apply_chat_template(tokenize=True)``)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template; pass chat_template explicitly")
    continue_final = kwargs.pop("continue_final_message", False)
    add_special = kwargs.pop("add_special_tokens", False)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt and not continue_final,
                                         tokenize=False, chat_template=chat_template, **kwargs)
    if continue_final:
        text = cut_after_final_message(text, messages)
    return text, list(tokenizer.encode(text, add_special_tokens=add_special))


def cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """The rendered conversation up to the end of the final message's content, so the model goes on
    writing that message (continue_final_message, as transformers does it)."""
    final = messages[-1].get("content")
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a final message with text content")
    end = text.rfind(final.strip())
    if end < 0:
        raise ValueError("continue_final_message: the chat template did not render the final message's content")
    return text[: end + len(final.strip())]


_SPECIAL_VARS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def chat_template_variables(tokenizer) -> dict[str, Any]:
    """The variables a Hugging Face chat template sees besides the messages (special tokens)."""
    out: dict[str, Any] = {}
    for name in _SPECIAL_VARS:
        value = getattr(tokenizer, name, None)
        out[name] = value if isinstance(value, str) or value is None else str(value)
    # transformers 5 dropped additional_special_tokens (ours and 4.x's tokenizers have it)
    out["additional_special_tokens"] = [str(t) for t in (getattr(tokenizer, "additional_special_tokens", None) or [])]
    return out


def render_request_template(tokenizer, sandbox, template: str, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, tools: Optional[list] = None, **kwargs) -> list[int]:
    """A chat template sent with a request: rendered in ``sandbox`` (a TemplateSandbox: another
    process, bounded in time, memory and output), then encoded as transformers does. ``kwargs``:
    extra template variables (chat_template_kwargs)."""
    variables = chat_template_variables(tokenizer)
    variables.update(kwargs)
    continue_final = variables.pop("continue_final_message", False)
    add_special = variables.pop("add_special_tokens", False)
    variables.setdefault("documents", None)
    variables.update(messages=messages, add_generation_prompt=add_generation_prompt and not continue_final, tools=tools)
    text = sandbox.render(template, variables)
    if continue_final:
        text = cut_after_final_message(text, messages)
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def max_token_chars(tokenizer) -> int:
    """The longest token's length in characters (an upper bound on the text one token covers)."""
    try:
        vocab = tokenizer.get_vocab()
        return max(16, max((len(t) for t in vocab), default=16))
    except Exception:
        return 64
