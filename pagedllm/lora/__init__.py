"""Multi-LoRA serving: PEFT adapters read and checked (peft_adapter), the engine's registry of
known adapters (registry), the worker's fixed adapter slots with a CPU-side LRU cache (slots), and
the linear layers' batched per-slot deltas (layers, ops)."""
