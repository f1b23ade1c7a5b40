"""The router's settings (``pagedllm router`` flags), checked once when made."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.entrypoints.router.replicas import POLICIES


@dataclass(frozen=True)
class RouterArgs:
    backends: tuple[str, ...]
    model: Optional[str] = None  # tokenizer directory (the served model's); None: no prefix routing
    tokenizer: Optional[str] = None  # overrides model for the tokenizer files
    served_model_names: tuple[str, ...] = ()  # base-model names (requests naming others are keyed apart)
    block_size: int = 16  # must equal the replicas' --block-size
    policy: str = "prefix"
    index_capacity_blocks: int = 1 << 16  # per replica; set near the replicas' KV cache block count
    max_load_imbalance: int = 8
    min_prefix_ratio: float = 0.5
    health_interval_s: float = 2.0
    retry_min_s: float = 1.0
    retry_max_s: float = 30.0
    connect_timeout_s: float = 5.0
    max_request_body_size: int = 64 << 20
    http_read_timeout: float = 30.0  # seconds to receive a request's headers, and between body chunks
    api_key: Optional[str] = None  # checked here before a body is read (None: only the replicas check)
    chat_template: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("router: --backends needs at least one URL")
        if self.policy not in POLICIES:
            raise ValueError(f"router: --routing must be one of {POLICIES}, got {self.policy!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"router: --block-size must be a power of two, got {self.block_size}")
        if self.index_capacity_blocks < 1:
            raise ValueError(f"router: --index-capacity-blocks must be >= 1, got {self.index_capacity_blocks}")
        if self.health_interval_s <= 0 or self.retry_min_s <= 0 or self.retry_max_s < self.retry_min_s:
            raise ValueError("router: need health_interval_s > 0 and 0 < retry_min_s <= retry_max_s")
        if self.max_request_body_size < 1 or not self.http_read_timeout > 0:
            raise ValueError("router: need max_request_body_size >= 1 byte and http_read_timeout > 0")
