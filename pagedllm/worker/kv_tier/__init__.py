"""The KV offload tier, worker side: the store Protocol and its implementations, and the runner's
copies between the device KV cache and the store (core/kv_tier.py plans what moves)."""
