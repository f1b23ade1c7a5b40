"""BERT-style encoders for pooling (``BertModel``, ``XLMRobertaModel``) and their cross-encoder
classifiers (``BertForSequenceClassification``, ``XLMRobertaForSequenceClassification``).

Bidirectional attention within each sequence, no KV cache: a batch is many sequences' tokens
laid out one after another ([T, hidden], like the decoder runner's flat batch); the linear layers
run over the flat tokens, attention over the sequences padded to the longest one with the
padding keys masked. Post-norm layers as in BERT: LayerNorm(x + attention), LayerNorm(x + MLP).
XLM-RoBERTa numbers positions from ``pad_token_id + 1``. Module names follow the checkpoint's
(after its ``bert.`` / ``roberta.`` prefix), so tensors load by name.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.activation import gelu_approximate
from pagedllm.layers.linear import ReplicatedLinear, materialize

ENCODER_ARCHS = ("BertModel", "XLMRobertaModel", "RobertaModel")
CLASSIFIER_ARCHS = ("BertForSequenceClassification", "XLMRobertaForSequenceClassification",
                    "RobertaForSequenceClassification")
_PREFIXES = ("bert.", "roberta.")


class _Embeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(getattr(config, "type_vocab_size", 2) or 1, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)

    def forward(self, input_ids, positions, token_type_ids) -> torch.Tensor:
        e = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(e + self.position_embeddings(positions))


class _SelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.query, self.key, self.value = (ReplicatedLinear(h, h, bias=True) for _ in range(3))


class _Output(nn.Module):
    def __init__(self, inner: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(inner, hidden, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = _SelfAttention(config)
        self.output = _Output(config.hidden_size, config.hidden_size, config.layer_norm_eps)


class _Intermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.approximate = gelu_approximate(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class _Layer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _Output(config.intermediate_size, config.hidden_size, config.layer_norm_eps)
        self.heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.heads

    def forward(self, h: torch.Tensor, batch: "EncoderBatch") -> torch.Tensor:
        sa = self.attention.self
        B, L = batch.index.shape
        q, k, v = (proj(h).view(-1, self.heads, self.head_dim) for proj in (sa.query, sa.key, sa.value))
        # [T, H, D] -> [B, H, L, D] (padding rows read token 0; their keys are masked out)
        q, k, v = (t[batch.index].transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.key_mask)
        o = o.transpose(1, 2).reshape(B * L, -1)[batch.flat_rows]
        h = self.attention.output(o, h)
        return self.output(self.intermediate(h), h)


class EncoderBatch:
    """Where a flat batch's sequences are: ``index`` [B, L] token rows (padded with row 0),
    ``key_mask`` [B, 1, 1, L] (True where a real key), ``flat_rows`` the padded rows of the real
    tokens in flat order."""

    def __init__(self, seq_lens: list[int], device: torch.device) -> None:
        L = max(seq_lens)
        starts = torch.tensor([0] + seq_lens[:-1]).cumsum(0)
        lens = torch.tensor(seq_lens)
        offs = torch.arange(L)
        real = offs[None, :] < lens[:, None]
        self.index = torch.where(real, starts[:, None] + offs[None, :], 0).to(device)
        self.key_mask = real[:, None, None, :].to(device)
        self.flat_rows = torch.nonzero(real.reshape(-1)).squeeze(1).to(device)
        self.starts = starts.to(device)
        self.seq_lens = lens.to(device)


class BertEncoder(nn.Module):
    """Embeddings and layers; ``forward`` returns the last hidden states [T, hidden]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList([_Layer(config) for _ in range(config.num_hidden_layers)])
        roberta = getattr(config, "model_type", "") in ("xlm-roberta", "roberta")
        self.position_offset = (config.pad_token_id + 1) if roberta else 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                batch: EncoderBatch) -> torch.Tensor:
        h = self.embeddings(input_ids, positions + self.position_offset, token_type_ids)
        for layer in self.encoder.layer:
            h = layer(h, batch)
        return h


class SequenceClassifier(nn.Module):
    """The classification head on the first token: BERT's pooler (dense + tanh) then
    ``classifier``; RoBERTa's ``classifier.dense`` + tanh then ``classifier.out_proj``."""

    def __init__(self, config, roberta: bool) -> None:
        super().__init__()
        h, n = config.hidden_size, config.num_labels
        self.roberta = roberta
        if roberta:
            self.classifier = nn.Module()
            self.classifier.dense = ReplicatedLinear(h, h, bias=True)
            self.classifier.out_proj = ReplicatedLinear(h, n, bias=True)
        else:
            self.pooler = nn.Module()
            self.pooler.dense = ReplicatedLinear(h, h, bias=True)
            self.classifier = ReplicatedLinear(h, n, bias=True)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        if self.roberta:
            return self.classifier.out_proj(torch.tanh(self.classifier.dense(first_tokens)))
        return self.classifier(torch.tanh(self.pooler.dense(first_tokens)))


def build_encoder(config, arch: str) -> tuple[BertEncoder, Optional[SequenceClassifier]]:
    encoder = BertEncoder(config)
    head = SequenceClassifier(config, arch.startswith(("XLMRoberta", "Roberta"))) if arch in CLASSIFIER_ARCHS else None
    return encoder, head


def load_encoder(encoder: BertEncoder, head: Optional[SequenceClassifier], tensors) -> None:
    """Checkpoint tensors by name (prefix ``bert.`` / ``roberta.`` dropped): the encoder's, and the
    head's (``pooler.*`` / ``classifier.*``). An encoder's unused pooler and MLM/NSP heads are
    skipped; a missing tensor is an error naming it."""
    enc, hd = dict(encoder.named_parameters()), dict(head.named_parameters()) if head is not None else {}
    loaded = set()
    for name, src in tensors:
        for p in _PREFIXES:
            if name.startswith(p):
                name = name[len(p):]
        target = enc.get(name) if name in enc else hd.get(name)
        if target is None:
            if name.startswith(("pooler.", "cls.", "lm_head.")) or name.endswith("position_ids"):
                continue  # the pooler of an encoder used for embeddings; pretraining heads
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in the encoder")
        t = materialize(src)
        if t.shape != target.shape:
            raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(t.shape)}, expected {tuple(target.shape)}")
        target.data.copy_(t)
        loaded.add(name)
    missing = [n for n in list(enc) + list(hd) if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
