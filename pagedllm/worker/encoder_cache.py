"""The runner's encoder cache: each running request's images (contracts.MultiModalFeature) and
the encoder outputs not yet consumed by its prefill.

A step's chunk of a request covers positions [start, start + n); every image whose placeholder
span overlaps it contributes the rows of its encoder output that fall inside the chunk. An image
is encoded the first time one of its positions is scheduled (the step's new images in one batch
per pixel shape) and its output kept until the chunk that reaches its last position, so chunked
prefill may split an image anywhere, and a prefix-cache hit that covers part of an image (its
hash keys those blocks) encodes it only for the rows still to compute. A preempted or finished
request's entry goes; a resumed one is sent again in full and re-encodes what it still needs."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.core.contracts import MultiModalFeature


class NoImages:
    """A text-only model's encoder cache: requests carry no images (the front end refuses them)."""

    def add(self, req_id: str, features: tuple) -> None:
        pass

    def drop(self, req_id: str) -> None:
        pass

    def step_embeds(self, req_ids, starts, num_scheduled, query_start_loc) -> None:
        return None


def encoder_cache_for(model, device: torch.device):
    """A multimodal model's EncoderCache, or NoImages."""
    return EncoderCache(model, device) if getattr(model, "supports_multimodal", False) else NoImages()


class EncoderCache:
    def __init__(self, model, device: torch.device) -> None:
        self.model = model  # has embed_images(pixel_values [N, 3, H, W]) -> [N, positions, hidden]
        self.device = device
        self.features: dict[str, tuple[MultiModalFeature, ...]] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}  # (request id, image index) -> [length, hidden]
        self.num_encoded = 0  # images run through the encoder (tests read it)

    def add(self, req_id: str, features: tuple[MultiModalFeature, ...]) -> None:
        self.drop(req_id)
        if features:
            self.features[req_id] = features

    def drop(self, req_id: str) -> None:
        feats = self.features.pop(req_id, ())
        for k in range(len(feats)):
            self.outputs.pop((req_id, k), None)

    def step_embeds(self, req_ids: list[str], starts: np.ndarray, num_scheduled: np.ndarray,
                    query_start_loc: np.ndarray) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(flat token indices [K], features [K, hidden]) of this step's image positions, or None."""
        pieces = []  # (key, first row, end row, flat index of the first row)
        for i, rid in enumerate(req_ids):
            feats = self.features.get(rid)
            if not feats:
                continue
            a = int(starts[i])
            b = a + int(num_scheduled[i])
            for k, f in enumerate(feats):
                lo, hi = max(a, f.offset), min(b, f.offset + f.length)
                if lo < hi:
                    pieces.append(((rid, k), lo - f.offset, hi - f.offset, int(query_start_loc[i]) + lo - a))
        if not pieces:
            return None
        self._encode([key for key, *_ in pieces if key not in self.outputs])
        index = np.concatenate([np.arange(at, at + hi - lo) for _, lo, hi, at in pieces])
        rows = torch.cat([self.outputs[key][lo:hi] for key, lo, hi, _ in pieces])
        for (rid, k), _, hi, _ in pieces:  # an image whose last position is computed now is done
            if hi == self.features[rid][k].length:
                del self.outputs[(rid, k)]
        return torch.from_numpy(index).to(self.device), rows

    def _encode(self, keys: list[tuple[str, int]]) -> None:
        by_shape: dict[tuple, list[tuple[str, int]]] = {}
        for key in dict.fromkeys(keys):
            by_shape.setdefault(self.features[key[0]][key[1]].data.shape, []).append(key)
        dtype = next(self.model.parameters()).dtype
        for group in by_shape.values():
            pixels = torch.from_numpy(np.stack([self.features[r][k].data for r, k in group]))
            out = self.model.embed_images(pixels.to(self.device, dtype))
            for key, emb in zip(group, out):
                f = self.features[key[0]][key[1]]
                if emb.shape[0] != f.length:
                    raise ValueError(f"the encoder made {emb.shape[0]} positions for an image with {f.length} "
                                     "placeholders")
                self.outputs[key] = emb
            self.num_encoded += len(group)
