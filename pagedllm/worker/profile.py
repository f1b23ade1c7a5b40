"""GPU memory profiling: peak activation memory of one forward at the largest step size."""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.forward_context import set_attention_metadata


@torch.inference_mode()
def profile_peak_forward(worker, num_tokens: int) -> int:
    spec = worker.kv_spec
    dev = worker.device
    seq_len = min(num_tokens, worker.max_model_len)
    num_seqs = -(-num_tokens // seq_len)
    blocks_per_seq = -(-seq_len // spec.block_size)
    num_blocks = num_seqs * blocks_per_seq
    tmp, tmp_scales = spec.allocate(num_blocks, dev)
    layers = worker.model.attention_layers()
    for i, layer in enumerate(layers):
        if tmp_scales is None:
            layer.bind(worker.backend, tmp[:, i])
        else:
            layer.bind(worker.backend, tmp[:, i], tmp_scales[:, i])
    lens = np.full(num_seqs, seq_len, dtype=np.int64)
    lens[-1] = num_tokens - seq_len * (num_seqs - 1)
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    bt = np.arange(num_blocks, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
    positions = np.concatenate([np.arange(n) for n in lens])
    req = np.repeat(np.arange(num_seqs), lens)
    slots = bt[req, positions // spec.block_size].astype(np.int64) * spec.block_size + positions % spec.block_size
    md = AttentionMetadata.from_host(qsl, lens, bt, slots, dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with set_attention_metadata(md):
        hidden = worker.model(torch.zeros(num_tokens, dtype=torch.long, device=dev), torch.from_numpy(positions).to(dev))
        worker.model.compute_logits(hidden[-min(num_tokens, worker.config.max_num_seqs):])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del tmp, tmp_scales, hidden
    torch.cuda.empty_cache()
    return int(peak)
