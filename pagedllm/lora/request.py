"""LoRARequest: which adapter a request runs with (vLLM's shape)."""
from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Optional

MAX_LORA_NAME_CHARS = 256  # a name is a model name in the API, a log field and a metrics label


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name`` names the adapter (the server's ``model``); ``lora_path`` is a directory as
    PEFT saves it (adapter_config.json + adapter_model.safetensors). ``lora_int_id`` is kept for
    vLLM compatibility only: the engine identifies an adapter by its name and a hash of its files
    (an id may be reused for other weights, a hash may not), so the prefix cache never mixes two
    adapters' KV."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if len(self.lora_name) > MAX_LORA_NAME_CHARS:
            raise ValueError(f"lora_name is {len(self.lora_name)} characters, over the limit of {MAX_LORA_NAME_CHARS}")
        if any(unicodedata.category(c)[0] in "CZ" and c != " " for c in self.lora_name):
            raise ValueError(f"lora_name must not hold control, format or separator characters (a newline, a tab, "
                             f"...), got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must name the adapter's directory")
