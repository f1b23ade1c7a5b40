"""Tiny random-weight pooling checkpoints built locally: BERT / XLM-RoBERTa encoders (one with a
sentence-transformers mean-pooling config), their sequence classifiers (cross-encoders) and a
Qwen3 decoder used for last-token embeddings; a WordPiece tokenizer with [CLS]/[SEP] and segment
ids."""
from __future__ import annotations

import json
import os

import torch

VOCAB = 200
_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _bert_tokenizer(path: str, token_types: bool = True) -> None:
    """WordPiece over w0..wN with BERT's template: [CLS] A [SEP] (B [SEP]), segment ids 0 / 1
    (``token_types`` False: token_type_ids not among its model_input_names, so the tokenizer
    does not hand them to the model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = _SPECIAL + [f"w{i}" for i in range(VOCAB - len(_SPECIAL))]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"] if token_types
                                   else ["input_ids", "attention_mask"])
    fast.save_pretrained(path)


def _widen(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)


def make_pooling_checkpoint(path: str, kind: str, seed: int = 0) -> str:
    """kind: bert_mean (BertModel + sentence-transformers mean pooling, normalised, Matryoshka),
    xlmr_cls (XLMRobertaModel, CLS), bert_rerank / xlmr_rerank (sequence classifiers, one label),
    bert_rerank_notypes (bert_rerank whose tokenizer returns no token_type_ids), bert_classify (a
    BERT sequence classifier with three named labels), qwen3_embed (a Qwen3ForCausalLM checkpoint,
    last-token pooling)."""
    import transformers as tf

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    if kind == "qwen3_embed":
        from checkpoints import make_checkpoint

        return make_checkpoint(path, "qwen3", seed=seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  initializer_range=0.1)
    if kind.startswith("bert"):
        cfg = tf.BertConfig(max_position_embeddings=128, pad_token_id=0, **common)
        cls = tf.BertForSequenceClassification if "rerank" in kind or kind == "bert_classify" else tf.BertModel
    else:
        cfg = tf.XLMRobertaConfig(max_position_embeddings=130, pad_token_id=1, type_vocab_size=1, **common)
        cls = tf.XLMRobertaForSequenceClassification if kind.endswith("rerank") else tf.XLMRobertaModel
    if "rerank" in kind:
        cfg.num_labels = 1
    if kind == "bert_classify":
        cfg.num_labels = 3
        cfg.id2label, cfg.label2id = {0: "neg", 1: "neu", 2: "pos"}, {"neg": 0, "neu": 1, "pos": 2}
    if kind == "bert_mean":
        cfg.is_matryoshka = True
    model = cls(cfg).float().eval()
    _widen(model)
    model.save_pretrained(path, safe_serialization=True)
    _bert_tokenizer(path, token_types=not kind.endswith("notypes"))
    if kind == "bert_mean":
        with open(os.path.join(path, "modules.json"), "w") as f:
            json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                       {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                       {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], f)
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
                       "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}, f)
    return path
