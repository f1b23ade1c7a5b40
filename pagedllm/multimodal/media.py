"""Images from what a caller hands over: a PIL image, a numpy array (H x W x 3 or H x W, uint8),
a ``data:`` URL (base64), or a local file (a path or ``file://`` URL) under the directory the
operator allowed (``allowed_local_media_path``, vLLM's ``--allowed-local-media-path``; none by
default). Remote ``http(s)://`` URLs are refused: this server never fetches an address a request
names. Every failure is a ValueError saying what was wrong (the server answers it with a 400
naming the field)."""
from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any, Optional

MAX_IMAGE_PIXELS = 32 * 1024 * 1024  # larger images are refused before they are decoded


def _pil():
    try:
        import PIL.Image
    except ImportError:  # pragma: no cover - Pillow comes with the multimodal extra
        raise ValueError("image inputs need Pillow (pip install 'pagedllm[multimodal]')") from None
    return PIL.Image


def load_image(source: Any, allowed_local_media_path: Optional[str] = None):
    """A PIL image (decoded, not yet converted to RGB) from any of the accepted sources."""
    Image = _pil()
    if isinstance(source, Image.Image):
        _check_size(source.size)
        return source
    if type(source).__module__ == "numpy" and hasattr(source, "ndim"):
        return _from_array(Image, source)
    if not isinstance(source, str):
        raise ValueError(f"an image must be a PIL image, a numpy array, a data: URL or a file path, got "
                         f"{type(source).__name__}")
    if source.startswith("data:"):
        return _decode(Image, _data_url_bytes(source), "the data: URL")
    if source.startswith(("http://", "https://")):
        raise ValueError("remote image URLs are not fetched by this server: send the image inline as a data: URL "
                         "(data:image/png;base64,...)")
    if "://" in source and not source.startswith("file://"):
        raise ValueError(f"unsupported image URL scheme {source.split('://', 1)[0]!r} (data: URLs, or file:// "
                         "under the server's allowed_local_media_path)")
    return _decode(Image, _local_file_bytes(source, allowed_local_media_path), "the image file")


def _check_size(size: tuple[int, int]) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ValueError(f"the image is empty ({w}x{h})")
    if w * h > MAX_IMAGE_PIXELS:
        raise ValueError(f"the image is {w}x{h} pixels, over the limit of {MAX_IMAGE_PIXELS} pixels")


def _from_array(Image, arr):
    import numpy as np

    if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (1, 3, 4)):
        raise ValueError(f"a numpy image must be uint8 of shape (H, W), (H, W, 3) or (H, W, 4), got {arr.dtype} "
                         f"{tuple(arr.shape)}")
    _check_size((arr.shape[1], arr.shape[0]))
    return Image.fromarray(arr[:, :, 0] if arr.ndim == 3 and arr.shape[2] == 1 else arr)


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ValueError("a data: URL needs a comma before its payload (data:image/png;base64,...)")
    mime, *params = header.split(";")
    if mime and not mime.startswith("image/"):
        raise ValueError(f"the data: URL holds {mime!r}, not an image")
    if "base64" not in params:
        raise ValueError("only base64 data: URLs are supported (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data: URL's payload is not valid base64") from None


def _local_file_bytes(path: str, allowed: Optional[str]) -> bytes:
    if path.startswith("file://"):
        path = path[len("file://"):]
    if not allowed:
        raise ValueError("local image files are not allowed on this server (its allowed_local_media_path is unset)")
    root = os.path.realpath(allowed)
    real = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
    if os.path.commonpath([root, real]) != root:
        raise ValueError("the image file is outside the server's allowed_local_media_path")
    if not os.path.isfile(real):
        raise ValueError("the image file does not exist")
    with open(real, "rb") as f:
        return f.read()


def _decode(Image, data: bytes, what: str):
    try:
        img = Image.open(io.BytesIO(data))
        _check_size(img.size)  # before the pixels are decoded: a small file may claim a huge image
        img.load()
    except ValueError:
        raise
    except Exception as e:  # PIL raises many types for bad data (UnidentifiedImageError, OSError, ...)
        raise ValueError(f"{what} is not a readable image ({type(e).__name__})") from None
    return img
