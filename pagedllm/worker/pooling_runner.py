"""The pooling runner (``runner="pooling"``): many sequences' tokens in ONE forward, their hidden
states pooled into one vector each (embeddings), a classifier's scores, or every token's vector.

Two model kinds:
- BERT-style encoders and cross-encoders (models/bert.py): bidirectional attention, no KV cache;
- the decoder families of the registry (e.g. a Qwen3 / Llama checkpoint used for embeddings as
  Qwen3-Embedding is): built and bound by the generative ``Worker`` (same loading, quantization,
  CPU kernels), its paged attention writing into a scratch KV cache that holds one batch and is
  overwritten by the next (nothing is kept between requests; every sequence is a fresh prefill).

Single process only (tensor / pipeline parallelism are refused). The generative ModelRunner is
not used: this runner builds its own flat batch and attention metadata.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.forward_context import set_attention_metadata
from pagedllm.config import hf_field
from pagedllm.models.bert import CLASSIFIER_ARCHS, ENCODER_ARCHS, EncoderBatch, build_encoder, load_encoder
from pagedllm.models.loader import iterate_weights
from pagedllm.models.pooler_config import PoolerConfig


def is_pooling_architecture(arch: str) -> bool:
    return arch in ENCODER_ARCHS or arch in CLASSIFIER_ARCHS


@dataclass
class PooledBatch:
    """One forward's results, per sequence in batch order: ``hidden`` the token vectors
    ([len, hidden] each, after the final norm) and, for a classifier, ``logits``."""

    hidden: list[torch.Tensor]
    logits: Optional[torch.Tensor]


class PoolingRunner:
    def __init__(self, config, hf_config, max_model_len: int, max_num_batched_tokens: int) -> None:
        from pagedllm.distributed.parallel_state import PPGroup, TPGroup, set_pp_group, set_tp_group
        from pagedllm.worker.worker import resolve_device, resolve_dtype

        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            raise ValueError("runner='pooling' runs in one process: tensor_parallel_size and pipeline_parallel_size "
                             "must be 1")
        set_tp_group(TPGroup())
        set_pp_group(PPGroup())
        self.arch = (hf_field(hf_config, "architectures") or ["?"])[0]
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.is_encoder = is_pooling_architecture(self.arch)
        self.is_classifier = self.arch in CLASSIFIER_ARCHS
        self.num_labels = int(hf_field(hf_config, "num_labels", 0) or 0) if self.is_classifier else 0
        self.device = resolve_device(config.device)
        if self.is_encoder:
            self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
            torch.manual_seed(config.seed)
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                with torch.device(self.device):
                    self.encoder, self.head = build_encoder(hf_config, self.arch)
            finally:
                torch.set_default_dtype(prev)
            load_encoder(self.encoder, self.head, iterate_weights(config.model))
            self.encoder.eval()
            self.worker = None
        else:
            from pagedllm.worker.worker import Worker

            self.worker = Worker(config, hf_config, max_model_len, max_num_batched_tokens)
            self.dtype = self.worker.dtype
            bs = self.worker.kv_spec.block_size
            # one batch: its tokens plus at most one partly filled block per sequence
            self.worker.initialize_cache(-(-max_num_batched_tokens // bs) + config.max_num_seqs)
            self.block_size = bs

    @property
    def hidden_size(self) -> int:
        if self.worker is None:
            return self.encoder.config.hidden_size
        return self.worker.hf_config.hidden_size

    @torch.inference_mode()
    def run(self, seqs: list[list[int]], token_types: Optional[list[list[int]]] = None) -> PooledBatch:
        """One forward over ``seqs`` (their total within max_num_batched_tokens)."""
        lens = [len(s) for s in seqs]
        flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=sum(lens))
        ids = torch.from_numpy(flat).to(self.device)
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).to(self.device)
        if self.worker is None:
            types = (torch.from_numpy(np.fromiter((t for s in token_types for t in s), dtype=np.int64,
                                                  count=len(flat))).to(self.device)
                     if token_types is not None else torch.zeros_like(ids))
            batch = EncoderBatch(lens, self.device)
            hidden = self.encoder(ids, positions, types, batch)
            logits = self.head(hidden[batch.starts]).float() if self.head is not None else None
        else:
            with set_attention_metadata(self._metadata(lens)):
                hidden = self.worker.model(ids, positions)
            logits = None
        return PooledBatch(list(hidden.split(lens)), logits)

    def _metadata(self, lens: list[int]) -> AttentionMetadata:
        """Every sequence a fresh prefill into consecutive scratch blocks."""
        bs = self.block_size
        blocks = [-(-n // bs) for n in lens]
        width = max(blocks)
        table = np.zeros((len(lens), width), dtype=np.int32)
        slots, first = [], 0
        for i, (n, nb) in enumerate(zip(lens, blocks)):
            table[i, :nb] = np.arange(first, first + nb)
            slots.append(first * bs + np.arange(n))
            first += nb
        qsl = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        return AttentionMetadata.from_host(qsl, np.array(lens, dtype=np.int64), table,
                                           np.concatenate(slots).astype(np.int64), self.device)


def pool(hidden: list[torch.Tensor], cfg: PoolerConfig, dimensions: Optional[int] = None) -> list[torch.Tensor]:
    """One float32 vector per sequence: CLS / MEAN / LAST, truncated to ``dimensions``
    (Matryoshka), then L2-normalised if the config says so."""
    if cfg.pooling_type == "CLS":
        vecs = torch.stack([h[0] for h in hidden])
    elif cfg.pooling_type == "LAST":
        vecs = torch.stack([h[-1] for h in hidden])
    else:
        vecs = torch.stack([h.float().mean(0) for h in hidden])
    vecs = vecs.float()
    if dimensions is not None:
        vecs = vecs[:, :dimensions]
    if cfg.normalize:
        vecs = F.normalize(vecs, p=2, dim=-1)
    return list(vecs.cpu())


def classifier_scores(logits: torch.Tensor) -> torch.Tensor:
    """Scores from a classifier's logits as sentence-transformers' CrossEncoder gives them:
    sigmoid of the one logit of a single-label head, else the softmax over the labels."""
    if logits.shape[-1] == 1:
        return torch.sigmoid(logits[:, 0])
    return torch.softmax(logits, dim=-1)
