"""CUDA graphs for decode-only steps.

A decode step of a small model is a few hundred tiny kernel launches; on a GPU the launch
overhead, not the math, sets its time. So at start-up the forward pass is captured once per
batch size of a ladder (1, 2, 4, 8, 16, 32, ... up to ``max_num_seqs``) on static input
buffers, and a decode-only step of B requests replays the graph of the smallest captured size
>= B after copying its inputs into the buffers. Rows past B are padding: slot -1 (the cache
write skips them), context length 1 over block 0 (a harmless read), outputs ignored. Mixed
prefill/decode steps and batches above the largest size run eagerly.

The attention backend must take everything that varies from device tensors (the Triton backend
does: host ints only size the grid, and they are fixed per graph). ``enforce_eager=True``
disables all of this. ``capture=False`` runs the same padded static-buffer forward eagerly,
which is how the CPU tests check the padding without a GPU.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.forward_context import set_attention_metadata

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    ladder = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
    sizes = [s for s in ladder if s < max_batch]
    return sizes + [max_batch] if max_batch <= 512 else sizes + [512]


class DecodeGraphRunner:
    def __init__(self, model, max_batch: int, max_blocks_per_seq: int, max_model_len: int, device: torch.device,
                 capture: bool = True) -> None:
        self.model = model
        self.device = device
        self.capture_enabled = capture
        self.sizes = capture_sizes(max_batch)
        self.max_model_len = max_model_len
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> Optional[int]:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def _metadata(self, size: int) -> AttentionMetadata:
        # Host mirrors describe the padded batch; max_seq_len is the longest possible context so
        # that a kernel's launch configuration chosen at capture is valid for every replay.
        return AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=np.arange(size + 1),
            seq_lens_cpu=np.full(size, self.max_model_len),
        )

    def _forward(self, size: int) -> torch.Tensor:
        with set_attention_metadata(self._metadata(size)):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first, sharing one memory pool (CUDA only)."""
        if not self.capture_enabled:
            return
        t0 = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles, allocator settles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.sizes, time.perf_counter() - t0)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only batch of B <= max_batch requests."""
        b = input_ids.shape[0]
        size = self.padded_size(b)
        assert size is not None, f"decode batch {b} exceeds the largest captured size {self.max_batch}"
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(seq_lens, non_blocking=True)
        self.block_table[:b, : block_table.shape[1]].copy_(block_table, non_blocking=True)
        if size > b:  # padding rows: no cache write, a one-token context in block 0
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.slot_mapping[b:size].fill_(-1)
            self.seq_lens[b:size].fill_(1)
            self.block_table[b:size].zero_()
        entry = self.graphs.get(size)
        if entry is None:  # capture disabled (tests on CPU) or not captured: same buffers, eager
            return self._forward(size)[:b]
        graph, out = entry
        graph.replay()
        return out[:b]
