"""How a pooling model turns token vectors into one embedding, read from the checkpoint's
sentence-transformers files when it has them: ``modules.json`` lists a Pooling module (its
``config.json`` says cls / mean / lasttoken) and, if the embeddings are L2-normalised, a
Normalize module. Without them: CLS for BERT-style encoders, the last token for decoders (as
Qwen3-Embedding pools), normalised. Matryoshka: ``matryoshka_dimensions`` / ``is_matryoshka``
in config.json."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

POOLING_TYPES = ("CLS", "MEAN", "LAST")
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling_type`` CLS (first token), MEAN or LAST (last token); L2 ``normalize``;
    ``matryoshka``: a prefix of the vector is an embedding too (``dimensions`` may truncate)."""

    pooling_type: str
    normalize: bool
    matryoshka: bool = False


def _read_json(path: str) -> Optional[object]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_pooler_config(model_dir: str, hf_config, is_encoder: bool) -> PoolerConfig:
    pooling = "CLS" if is_encoder else "LAST"
    normalize = True
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if isinstance(modules, list):
        types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        normalize = any(t.endswith("Normalize") for t in types)
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
                cfg = _read_json(os.path.join(model_dir, str(m.get("path", "")), "config.json")) or {}
                modes = [mode for key, mode in _ST_MODES.items() if cfg.get(key)]
                if len(modes) == 1:
                    pooling = modes[0]
                elif modes or any(k.startswith("pooling_mode") and v for k, v in cfg.items()):
                    raise ValueError(f"{model_dir}: sentence-transformers pooling {cfg} is not supported "
                                     f"(supported: one of {', '.join(_ST_MODES)})")
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or getattr(hf_config, "matryoshka_dimensions", None))
    return PoolerConfig(pooling, normalize, matryoshka)
