"""CLIP-style image preprocessing (LLaVA-1.5's CLIPImageProcessor), from the checkpoint's
preprocessor_config.json: convert to RGB (transparency composited onto white), resize (shortest
edge, or an exact height x width) with PIL's filter, center crop, rescale (x 1/255 in float64, then
float32), normalize ((x - mean) / std in float32). The same steps, in the same order and
precisions, as transformers' PIL backend, so the pixel values are the reference's
(tests/models/test_llava.py compares them).

An image of an extreme aspect ratio (a 1 x 1,000,000 PNG is a few KB) would resize to a huge one
the crop then mostly throws away: when the resized image would hold more than
FULL_RESIZE_MAX_CROPS crops' pixels, only the part the crop keeps is resampled (resize_region)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# A resized image of up to this many crops' pixels is made whole, by PIL's own resize as the reference
# does (byte-identical to it up to an aspect ratio of 64:1 when the crop is the short edge squared); a
# larger one is resampled only where the crop keeps (resize_region: within 1 LSB where PIL's passes
# run in the same order).
FULL_RESIZE_MAX_CROPS = 64
RGB_STRIP_PIXELS = 1 << 20  # to_rgb composites transparency onto white this many pixels at a time


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
            image = self._resize(image)
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

    def _resize(self, image):
        """The RGB image resized; only the part the center crop keeps when the whole would hold
        more than FULL_RESIZE_MAX_CROPS crops' pixels (the crop then has nothing left to cut along
        the long axis, and pads the short one as before)."""
        h, w = self._resize_shape(image.height, image.width)
        crop_h, crop_w = self.crop_size
        if not self.do_center_crop or h * w <= FULL_RESIZE_MAX_CROPS * crop_h * crop_w:
            return image.resize((w, h), resample=self.resample)
        (top, bottom), (left, right) = _kept_span(h, crop_h), _kept_span(w, crop_w)
        return resize_region(image, (w, h), (left, top, right, bottom), self.resample)

    def _resize_shape(self, height: int, width: int) -> tuple[int, int]:
        if self.resize_to is not None:
            return self.resize_to
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)


def to_rgb(image):
    """RGB, with any transparency composited onto white (as transformers does), RGB_STRIP_PIXELS
    at a time: the same pixels, without three full-size RGBA copies (a 4 KB palette PNG with
    transparency decodes to 32 megapixels)."""
    import PIL.Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    out = PIL.Image.new("RGB", image.size)
    rows = max(1, RGB_STRIP_PIXELS // image.width)
    for top in range(0, image.height, rows):
        rgba = image.crop((0, top, image.width, min(image.height, top + rows))).convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        out.paste(PIL.Image.alpha_composite(white, rgba).convert("RGB"), (0, top))
    return out


def _kept_span(size: int, crop: int) -> tuple[int, int]:
    """[start, end) of an axis of ``size`` pixels that center_crop to ``crop`` keeps (all of it
    when the crop is larger: it pads)."""
    start = (size - crop) // 2 if size >= crop else 0
    return start, start + min(size, crop)


def resize_region(image, size: tuple[int, int], region: tuple[int, int, int, int], resample: int):
    """``image.resize(size, resample).crop(region)`` without making the whole resized image: each
    kept output pixel samples the source at the same centre with the same filter support (PIL's
    ``box``), from the source cut to the pixels the filter reaches (so the box's coordinates, which
    PIL holds as float32, stay small). Equal to the full resize within 1 LSB (the centres' float
    rounding) when PIL runs its two passes in the same order; the other order rounds and clips the
    uint8 intermediate differently (up to 38 LSB on noise, 16 on text-like edges). So the passes run
    one axis at a time, horizontal first: the order PIL's full resize long used, and Pillow 13's for
    every shape but a tall image shrinking, which it resamples vertically first (Pillow 13 orders a
    single box resize by the box's own shape, which is why this makes two)."""
    (src_w, src_h), (w, h) = image.size, size
    left, top, right, bottom = region
    scale_x, scale_y = src_w / w, src_h / h
    x0, x1 = left * scale_x, min(src_w, right * scale_x)
    y0, y1 = top * scale_y, min(src_h, bottom * scale_y)
    c0, c1 = _filter_reach(x0, x1, scale_x, src_w)
    r0, r1 = _filter_reach(y0, y1, scale_y, src_h)
    rows = image.crop((c0, r0, c1, r1)).resize((right - left, r1 - r0), resample,
                                                box=(x0 - c0, 0, x1 - c0, r1 - r0))
    return rows.resize((right - left, bottom - top), resample, box=(0, y0 - r0, right - left, y1 - r0))


def _filter_reach(start: float, end: float, scale: float, size: int) -> tuple[int, int]:
    """[first, last) of the ``size`` source pixels a filter reads for the outputs over source
    coordinates [start, end), ``scale`` source pixels an output pixel: the widest filter of the
    configs (Lanczos) reads 3 pixels either side, 3 x scale when it shrinks."""
    reach = 3 * max(scale, 1.0) + 1
    return max(0, math.floor(start - reach)), min(size, math.ceil(end + reach))


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
