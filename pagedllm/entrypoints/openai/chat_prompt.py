"""A chat request's messages -> the prompt's token ids, through the chat template.

Rendering runs on worker threads, bounded: the messages' image parts are decoded (and fetched,
on a pool of their own) off the event loop; messages that could never fit max_model_len are
refused before rendering; a chat template sent with a request is refused unless the server
trusts them (``--trust-request-chat-template``), then rendered in a TemplateSandbox (another
process, bounded in time, memory and output).
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

from pagedllm.entrypoints.openai import tool_calls as tc
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ImageURL
from pagedllm.entrypoints.openai.serving_errors import APIError, bad_request


async def render_chat(serving, req: ChatCompletionRequest, tools: Optional[list] = None,
                      images: Optional[list] = None) -> list[int]:
    """The rendered conversation's token ids; ``images`` (a list) receives the images of its
    image_url parts, in prompt order (each part's text is the model's image placeholder).
    ``serving`` is the ServingBase (tokenizer, input processor, the server's options)."""
    from pagedllm.tokenizer.tokenizer import apply_chat_template, render_request_template

    if not req.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    serving.require_tokenizer("chat needs a tokenizer", "messages")
    contents = await _contents(serving, req, images if images is not None else [])
    messages = [tc.template_message(m, c or "") for m, c in zip(req.messages, contents)]
    limit = serving.input_processor.max_prompt_chars
    if limit and sum(len(m["content"]) for m in messages) > limit:
        raise APIError(400, f"the messages hold more than the {limit} characters that max_model_len "
                            f"({serving.max_model_len} tokens) could ever hold", param="messages",
                       code="context_length_exceeded")
    kwargs = _template_options(req)
    options = serving.options
    template = req.chat_template
    if template is None:
        return await _render("messages", apply_chat_template, serving.tokenizer, messages, req.add_generation_prompt,
                             options.chat_template, tools=tools, **kwargs)
    if not options.trust_request_chat_template or options.template_sandbox is None:
        raise APIError(400, "chat_template in a request is not allowed on this server (the server's "
                            "--trust-request-chat-template allows it)", param="chat_template",
                       code="chat_template_not_allowed")
    return await _render("chat_template", render_request_template, serving.tokenizer, options.template_sandbox,
                         template, messages, req.add_generation_prompt, tools=tools, **kwargs)


async def _render(param: str, render, /, *args, **kwargs) -> list[int]:
    """``render(*args, **kwargs)`` on a worker thread; its failures are the input's (400 naming ``param``)."""
    from pagedllm.tokenizer.chat_template import TemplateLimitError

    try:
        return await asyncio.to_thread(render, *args, **kwargs)
    except TemplateLimitError as e:
        raise APIError(400, f"the chat template exceeded its limits: {e}", param=param,
                       code="chat_template_limit") from None
    except Exception as e:  # template errors are caused by the input
        raise APIError(400, f"could not apply the chat template: {e}", param=param) from None


def _template_options(req: ChatCompletionRequest) -> dict[str, Any]:
    """The template's keyword arguments: chat_template_kwargs and vLLM's chat extensions."""
    kwargs = template_kwargs(req.chat_template_kwargs)
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true (set "
                              "add_generation_prompt false to continue the final message)", "continue_final_message")
        if req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", "continue_final_message")
        kwargs["continue_final_message"] = True
    if req.add_special_tokens:
        kwargs["add_special_tokens"] = True
    if req.documents is not None:
        kwargs["documents"] = req.documents
    return kwargs


def template_kwargs(kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """chat_template_kwargs: extra template variables; the ones the renderer sets itself and
    transformers' own apply_chat_template parameters are refused, naming the key."""
    from pagedllm.tokenizer.chat_template import RESERVED_TEMPLATE_KWARGS

    for key in kwargs or {}:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            why = "is set by the server" if key in RESERVED_TEMPLATE_KWARGS else "is not a template variable name"
            raise bad_request(f"chat_template_kwargs: {key!r} {why}", f"chat_template_kwargs.{key}")
    return dict(kwargs or {})


async def _contents(serving, req, images: list) -> list:
    """The messages' contents, image parts flattened (decoded, and fetched, off the event loop)."""
    contents = [m.content for m in req.messages]
    if not any(isinstance(c, list) for c in contents):
        return contents
    if _names_remote_image(contents):  # in threads of their own: a slow host never starves tokenizing
        from pagedllm.multimodal.media import fetch_pool

        return await asyncio.get_running_loop().run_in_executor(fetch_pool(), _flatten_contents, serving, contents,
                                                                images)
    return await asyncio.to_thread(_flatten_contents, serving, contents, images)


def _flatten_contents(serving, contents: list, images: list) -> list:
    from pagedllm.multimodal.chat_content import ContentError, flatten_content

    processor = serving.input_processor.images
    placeholder = processor.placeholder if processor is not None else None
    try:
        return [flatten_content([p.model_dump(exclude_none=True) for p in c], placeholder, images,
                                serving.input_processor.media, f"messages[{i}].content",
                                serving.engine.config.max_images_per_prompt)
                if isinstance(c, list) else c for i, c in enumerate(contents)]
    except ContentError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None


def _names_remote_image(contents: list) -> bool:
    """Whether a message's content parts name an http(s) image URL."""
    from pagedllm.multimodal.media import is_remote_url

    return any(is_remote_url(p.image_url.url if isinstance(p.image_url, ImageURL) else p.image_url)
               for c in contents if isinstance(c, list) for p in c)
