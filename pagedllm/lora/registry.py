"""The adapters an engine knows, by name: each checked once when first seen (files, rank, targets,
shapes against the base model) and identified by its name and a hash of its files."""
from __future__ import annotations

import os
import threading
from typing import Optional

from pagedllm.core.contracts import LoRAHandle
from pagedllm.lora.peft_adapter import ModelLoRALayout, adapter_digest, load_adapter
from pagedllm.lora.request import LoRARequest


def _require_request(request) -> None:
    if not isinstance(request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")


class LoRARegistry:
    def __init__(self, hf_config, max_lora_rank: int, max_adapters: int = 1024) -> None:
        self.layout = ModelLoRALayout.from_hf_config(hf_config)  # raises for models LoRA does not support
        self.max_lora_rank = max_lora_rank
        self.max_adapters = max_adapters  # names known at once (each holds a checked path and a hash)
        self._known: dict[str, tuple[LoRARequest, LoRAHandle]] = {}
        self._lock = threading.Lock()  # the server's load endpoint vs the engine thread

    def check(self, request: LoRARequest) -> LoRAHandle:
        """Read and check the adapter (ValueError naming what is wrong); its handle."""
        _require_request(request)
        path = os.path.abspath(request.lora_path)
        load_adapter(path, self.layout, self.max_lora_rank)
        return LoRAHandle(request.lora_name, f"{request.lora_name}:{adapter_digest(path)}", path)

    def resolve(self, request: LoRARequest) -> LoRAHandle:
        """The handle of a known adapter, or of a new one (checked, then remembered)."""
        _require_request(request)
        with self._lock:
            known = self._known.get(request.lora_name)
        if known is not None and known[0].lora_path == request.lora_path:
            return known[1]
        self._check_room(request.lora_name)
        handle = self.check(request)
        with self._lock:
            self._check_room(request.lora_name)
            self._known[request.lora_name] = (request, handle)
        return handle

    def _check_room(self, name: str) -> None:
        if name not in self._known and len(self._known) >= self.max_adapters:
            raise ValueError(f"the engine already knows {len(self._known)} LoRA adapters, the limit "
                             f"(max_registered_loras = {self.max_adapters}); unload one first")

    def add(self, request: LoRARequest) -> LoRAHandle:
        """Register a new name (ValueError if the name is taken)."""
        with self._lock:
            if request.lora_name in self._known:
                raise ValueError(f"a LoRA adapter named {request.lora_name!r} is already loaded")
        return self.resolve(request)

    def remove(self, name: str) -> bool:
        """Forget an adapter: new requests can no longer name it; running ones finish with it."""
        with self._lock:
            return self._known.pop(name, None) is not None

    def get(self, name: str) -> Optional[LoRARequest]:
        with self._lock:
            known = self._known.get(name)
        return known[0] if known is not None else None

    def requests(self) -> list[LoRARequest]:
        with self._lock:
            return [req for req, _ in self._known.values()]
