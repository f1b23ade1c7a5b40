"""CLIP-style image preprocessing (LLaVA-1.5's CLIPImageProcessor), from the checkpoint's
preprocessor_config.json: convert to RGB (transparency composited onto white), resize (shortest
edge, or an exact height x width) with PIL's filter, center crop, rescale (x 1/255 in float64, then
float32), normalize ((x - mean) / std in float32). The same steps, in the same order and
precisions, as transformers' PIL backend, so the pixel values are the reference's
(tests/models/test_llava.py compares them)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _size(value: Any, what: str) -> tuple[Optional[int], Optional[tuple[int, int]]]:
    """(shortest edge, None) or (None, (height, width)) from the config's spellings."""
    if isinstance(value, int):
        return value, None
    if isinstance(value, dict):
        if "shortest_edge" in value:
            return int(value["shortest_edge"]), None
        if "height" in value and "width" in value:
            return None, (int(value["height"]), int(value["width"]))
    raise ValueError(f"preprocessor_config.json: unsupported {what} {value!r}")


_RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


def _resample(value: Any) -> int:
    """PIL's filter number (configs write the number, or sometimes its name)."""
    if isinstance(value, str) and value.lower() in _RESAMPLE:
        return _RESAMPLE[value.lower()]
    if isinstance(value, int) and 0 <= value <= 5:
        return value
    raise ValueError(f"preprocessor_config.json: unsupported resample {value!r}")


@dataclass(frozen=True)
class ClipImageProcessor:
    do_resize: bool = True
    shortest_edge: Optional[int] = 224
    resize_to: Optional[tuple[int, int]] = None  # (height, width), when the size is exact
    resample: int = 3  # PIL's BICUBIC
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (224, 224)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def from_dir(cls, model_dir: str) -> "ClipImageProcessor":
        path = os.path.join(model_dir, "preprocessor_config.json")
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except OSError:
            raise ValueError(f"{path} is missing: an image model needs its image processor's config") from None
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if cfg.get("do_pad"):
            raise ValueError(f"{path}: do_pad (pad to square) is not supported yet")
        shortest, exact = _size(cfg.get("size", {"shortest_edge": 224}), "size")
        crop_short, crop = _size(cfg.get("crop_size", {"height": 224, "width": 224}), "crop_size")
        return cls(
            do_resize=bool(cfg.get("do_resize", True)), shortest_edge=shortest, resize_to=exact,
            resample=_resample(cfg.get("resample", 3)), do_center_crop=bool(cfg.get("do_center_crop", True)),
            crop_size=crop if crop is not None else (crop_short, crop_short),
            do_rescale=bool(cfg.get("do_rescale", True)), rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            do_normalize=bool(cfg.get("do_normalize", True)),
            image_mean=tuple(cfg.get("image_mean", OPENAI_CLIP_MEAN)), image_std=tuple(cfg.get("image_std", OPENAI_CLIP_STD)))

    @property
    def output_size(self) -> Optional[tuple[int, int]]:
        """(height, width) of every output, when it does not depend on the image."""
        if self.do_center_crop:
            return self.crop_size
        if self.do_resize and self.resize_to is not None:
            return self.resize_to
        return None

    def __call__(self, image) -> np.ndarray:
        """float32 [3, H, W] pixel values of a PIL image."""
        image = to_rgb(image)
        if self.do_resize:
            h, w = self._resize_shape(image.height, image.width)
            image = image.resize((w, h), resample=self.resample)
        x = np.moveaxis(np.asarray(image), -1, 0)  # [3, H, W] uint8
        if self.do_center_crop:
            x = center_crop(x, *self.crop_size)
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            x = x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)
            mean, std = np.array(self.image_mean, dtype=x.dtype), np.array(self.image_std, dtype=x.dtype)
            x = ((x.T - mean) / std).T
        return np.ascontiguousarray(x, dtype=np.float32)

    def _resize_shape(self, height: int, width: int) -> tuple[int, int]:
        if self.resize_to is not None:
            return self.resize_to
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)


def to_rgb(image):
    """RGB, with any transparency composited onto white (as transformers does)."""
    import PIL.Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre height x width of [C, H, W]; zero-padded (centred) where the image is smaller."""
    h, w = x.shape[-2:]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return x[..., top:top + height, left:left + width]
    nh, nw = max(height, h), max(width, w)
    padded = np.zeros(x.shape[:-2] + (nh, nw), dtype=x.dtype)
    tp, lp = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    padded[..., tp:tp + h, lp:lp + w] = x
    top, left = top + tp, left + lp
    return padded[..., max(0, top):min(nh, top + height), max(0, left):min(nw, left + width)]
