"""A prompt's images -> the token ids the model runs and one MultiModalFeature per image.

LLaVA-style models mark each image in the prompt with one placeholder token (``<image>``); the
processor expands it to the image's number of feature positions (the vision tower's patches, and
its class token with the "full" feature strategy), turns each image into the encoder's input
(image_processor.py) and hashes that input (sha256 of its shape and bytes): the hash keys the KV
blocks the image's positions fall in (core/block_hash.py), so the prefix cache tells images apart.
A prompt given as token ids may carry the placeholders unexpanded (one each) or already expanded
(a run of exactly the image's length). Adjacent placeholders are adjacent images: a run of k is k
unexpanded images, or k / num_image_tokens expanded ones where that divides, whichever reading
gives the prompt as many images as it was given (a tokenizer that drops whitespace joins the
placeholders of images back to back)."""
from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import numpy as np

from pagedllm.config import hf_field
from pagedllm.core.contracts import MultiModalFeature
from pagedllm.multimodal.image_processor import ClipImageProcessor
from pagedllm.multimodal.media import MediaSources, PixelBudget, load_image

MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)


def content_hash(pixels: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(f"image:{pixels.dtype}:{pixels.shape}".encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()


class ImagePromptProcessor:
    """``image_token_id``: the placeholder; ``num_image_tokens``: positions per image;
    ``placeholder``: its text (a chat message's image part becomes it); ``max_images``: images
    one prompt may carry."""

    def __init__(self, image_token_id: int, num_image_tokens: int, preprocess: ClipImageProcessor,
                 placeholder: str = "<image>", max_images: int = 16) -> None:
        self.image_token_id = image_token_id
        self.num_image_tokens = num_image_tokens
        self.preprocess = preprocess
        self.placeholder = placeholder
        self.max_images = max_images

    def images_of(self, multi_modal_data: Any) -> list:
        """The images of a prompt's ``multi_modal_data`` ({"image": one image or a list})."""
        if not isinstance(multi_modal_data, dict):
            raise ValueError("multi_modal_data must be a dict like {'image': image or [images]}")
        unknown = sorted(set(multi_modal_data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modality {unknown[0]!r} (supported: 'image')")
        images = multi_modal_data.get("image")
        if images is None:
            return []
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if len(images) > self.max_images:
            raise ValueError(f"multi_modal_data: {len(images)} images, over the limit of {self.max_images} a prompt "
                             "(limit_mm_per_prompt)")
        return images

    def process(self, token_ids: Sequence[int], images: Sequence[Any],
                media: Optional[MediaSources] = None) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """(the expanded token ids, one feature per image in prompt order)."""
        runs = self._placeholder_runs(token_ids, len(images))
        out: list[int] = []
        features = []
        prev = 0
        n = self.num_image_tokens
        budget = PixelBudget()
        for (start, length), image in zip(runs, images):
            out.extend(token_ids[prev:start])
            try:
                pixels = self.preprocess(load_image(image, media, budget))
            except ValueError as e:
                raise ValueError(f"multi_modal_data: image {len(features)}: {e}") from None
            features.append(MultiModalFeature(len(out), n, content_hash(pixels), pixels))
            out.extend([self.image_token_id] * n)
            prev = start + length
        out.extend(token_ids[prev:])
        return out, tuple(features)

    def _placeholder_runs(self, ids: Sequence[int], num_images: int) -> list[tuple[int, int]]:
        """(start, length) of each image's placeholders, ``num_images`` of them: each run of
        placeholder ids read as unexpanded images (1 each) or, where num_image_tokens divides it,
        as expanded ones; the first reading (expanded before unexpanded, run by run) that comes to
        ``num_images``. ValueError when none does."""
        runs = _runs(ids, self.image_token_id)
        readings = [self._readings(length) for _, length in runs]
        lengths = _reading_for(runs, readings, num_images)
        if lengths is None:
            likely = sum(length // per[0] for (_, length), per in zip(runs, readings))
            spread = sum(length for _, length in runs)
            counts = f"{likely}" if spread == likely else f"{likely} (or {spread} unexpanded)"
            raise ValueError(f"multi_modal_data: the prompt has {counts} image placeholder(s) "
                             f"({self.placeholder!r}) but {num_images} image(s) were given")
        return [(k, per) for (i, length), per in zip(runs, lengths) for k in range(i, i + length, per)]

    def _readings(self, length: int) -> tuple[int, ...]:
        """The placeholders per image a run of ``length`` may be read with, the likelier first."""
        n = self.num_image_tokens
        return (n, 1) if n > 1 and length % n == 0 else (1,)


def _runs(ids: Sequence[int], tok: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of ``tok`` in ``ids``."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] != tok:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == tok:
            j += 1
        runs.append((i, j - i))
        i = j
    return runs


def _reading_for(runs: list[tuple[int, int]], readings: list[tuple[int, ...]], num_images: int
                 ) -> Optional[list[int]]:
    """Placeholders per image for each run (one of its ``readings``) so that the runs hold
    ``num_images`` images, earlier runs' likelier readings first; None when no choice does."""
    reach: dict[int, list[int]] = {0: []}  # images so far -> the choices that got there first
    for (_, length), per_image in zip(runs, readings):
        step: dict[int, list[int]] = {}
        for total, chosen in reach.items():
            for per in per_image:
                if total + length // per <= num_images:
                    step.setdefault(total + length // per, chosen + [per])
        reach = step
    return reach.get(num_images)


def make_image_processor(model_dir: str, hf_config, tokenizer=None, max_images: int = 16
                         ) -> Optional[ImagePromptProcessor]:
    """The model's ImagePromptProcessor (at most ``max_images`` a prompt), or None for a model that
    takes no images."""
    archs = hf_field(hf_config, "architectures") or []
    if not any(a in MULTIMODAL_ARCHITECTURES for a in archs):
        return None
    vision = hf_config.vision_config
    preprocess = ClipImageProcessor.from_dir(model_dir)
    side = vision.image_size
    if preprocess.output_size != (side, side):
        raise ValueError(f"preprocessor_config.json makes {preprocess.output_size} images, the vision tower takes "
                         f"{side}x{side}")
    patches = (side // vision.patch_size) ** 2
    num = patches + (1 if hf_config.vision_feature_select_strategy == "full" else 0)
    tok = hf_config.image_token_index
    placeholder = "<image>"
    if tokenizer is not None:
        try:
            placeholder = tokenizer.convert_ids_to_tokens(tok) or placeholder
        except Exception:
            pass
    return ImagePromptProcessor(tok, num, preprocess, placeholder, max_images)
