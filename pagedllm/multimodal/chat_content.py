"""Chat messages whose content is a list of OpenAI content parts -> text for the chat template,
with the model's image placeholder where each image part was (parts joined by newlines, in their
order), and the images, loaded (multimodal/media.py).

Parts: ``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": ...}}``
(a ``data:`` URL, a local file under allowed_local_media_path, or an http(s) URL from one of the
allowed_media_domains; media.py), and offline
``{"type": "image_pil", "image_pil": <PIL image>}``. A bad part raises ContentError naming it
(``messages[1].content[0].image_url``): the server answers 400 with that as the param."""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.multimodal.media import MediaSources, PixelBudget, load_image


class ContentError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def flatten_messages(messages: list[dict[str, Any]], placeholder: Optional[str],
                     media: Optional[MediaSources] = None,
                     max_images: int = 16) -> tuple[list[dict[str, Any]], list]:
    """(messages with string contents, the images in prompt order). ``placeholder`` None: the
    model takes no images (an image part is refused)."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            m = dict(m, content=flatten_content(content, placeholder, images, media,
                                                f"messages[{i}].content", max_images))
        out.append(m)
    return out, images


def flatten_content(parts: list, placeholder: Optional[str], images: list,
                    media: Optional[MediaSources], where: str, max_images: int = 16) -> str:
    """``images`` receives the loaded images (more than ``max_images`` in all, or more pixels
    than media.MAX_REQUEST_PIXELS together: refused before the next one is decoded; ``images`` is
    the request's, shared by the calls for its messages); ``media``: where paths and URLs may lead
    (None: data: URLs only)."""
    budget = PixelBudget.after(images)
    texts = []
    for j, part in enumerate(parts):
        param = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ContentError("a text part needs a string 'text'", param)
            texts.append(part["text"])
            continue
        if kind not in ("image_url", "image_pil"):
            raise ContentError(f"unsupported content part type {kind!r} (supported: text, image_url)", param)
        param = f"{param}.{kind}"
        if placeholder is None:
            raise ContentError("this model takes no images", param)
        if len(images) >= max_images:
            raise ContentError(f"more than {max_images} images in one prompt (limit_mm_per_prompt)", param)
        source = part.get(kind)
        if kind == "image_url":
            source = source.get("url") if isinstance(source, dict) else source
            if not isinstance(source, str):
                raise ContentError("an image_url part needs {'url': 'data:image/...;base64,...'}", param)
        try:
            images.append(load_image(source, media, budget))
        except ValueError as e:
            raise ContentError(str(e), param) from None
        texts.append(placeholder)
    return "\n".join(texts)
