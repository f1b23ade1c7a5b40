#!/usr/bin/env python
"""Train pagedllm's small embedded default model on the tiny-shakespeare corpus.

Produces a standard Hugging Face model directory (Llama architecture, byte-level BPE
tokenizer) that ``transformers`` and pagedllm can load without any network access:

    config.json, generation_config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json, special_tokens_map.json,
    chat_template.jinja, README.md (model card with the measured validation loss),
    training_summary.json (the numbers of the card, machine-readable)

Recipe (everything is seeded; see ``--seed``):

* corpus: ``data/tinyshakespeare.txt`` (1,115,394 ASCII characters), split *by position*:
  the first 90% is training text, the last 10% is validation text;
* tokenizer: byte-level BPE (``tokenizers``), ``--vocab-size`` 2048 entries including the
  special tokens ``<s>`` (bos), ``</s>`` (eos) and ``<pad>``; trained on the training
  split only; ``ByteLevel(add_prefix_space=False)`` pre-tokenizer + ``ByteLevel`` decoder,
  so ``decode(encode(text)) == text`` for any text (spaces, newlines, unicode);
* model: ``LlamaForCausalLM`` (GQA, RoPE, SwiGLU, RMSNorm), a few million parameters;
* training: the training split is one token stream (``<s>`` + text); batches are random
  windows of ``--seq-len`` + 1 tokens; AdamW, linear warm-up then cosine decay, gradient
  clipping, plain PyTorch loop, fp32 on CPU.

Time budget: ``--minutes`` bounds the training loop (tokenizer training, final evaluation,
saving and the sample add well under a minute).  Unless ``--max-steps`` is given, the cosine
decay runs over the wall-clock budget (progress = elapsed / budget), so the schedule always
completes inside ``--minutes`` even on a shared machine whose speed varies.  ``--max-steps N``
makes the schedule step-based and the run independent of timing (bit-exactness additionally
needs the same torch version and thread count); training still stops at ``--minutes``.

Usage (from the repository root)::

    python scripts/train_default_model.py                       # default: 18 min, 2 threads
    python scripts/train_default_model.py --minutes 0.5 --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT / "data" / "tinyshakespeare.txt"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# Speaker-turn format that mirrors the corpus ("NAME:\n<lines>\n\n").
# system content is a free-standing first paragraph; every other message is rendered as
# "<NAME or ROLE upper-cased>:\n<content>\n\n"; the generation prompt opens the
# assistant's turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ message['content'] }}{{ '\\n\\n' }}"
    "{%- else -%}"
    "{%- if message['name'] is defined and message['name'] -%}"
    "{{ message['name'] | upper }}"
    "{%- else -%}"
    "{{ message['role'] | upper }}"
    "{%- endif -%}"
    "{{ ':\\n' }}{{ message['content'] }}{{ '\\n\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:\\n' }}{%- endif -%}"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/tiny-shakespeare", help="output model directory")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="training corpus (plain text)")
    p.add_argument("--minutes", type=float, default=18.0, help="wall-clock budget of the training loop")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--max-steps", type=int, default=None,
                   help="fixed number of optimizer steps (default: as many as fit in --minutes)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100, help="steps between quick validation checks")
    p.add_argument("--sample-tokens", type=int, default=200)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="draft: a much smaller model for speculative decoding (2 layers, hidden 128, 8 minutes, "
                        "models/tiny-shakespeare-draft) that reuses --tokenizer-from's tokenizer; flags given "
                        "explicitly still win")
    p.add_argument("--tokenizer-from", default=None,
                   help="reuse this model directory's tokenizer.json instead of training one (a draft model must "
                        "share its target's tokenizer)")
    preset = p.parse_known_args(argv)[0].preset
    if preset is not None:
        p.set_defaults(**PRESETS[preset])
    return p.parse_args(argv)


# A draft model for speculative decoding: same tokenizer as the default model, ~8x fewer FLOPs. Its
# steps are overhead-bound like the target's (cost ~ layers), so width is nearly free: 2 layers of 128.
PRESETS = {
    "draft": dict(out="models/tiny-shakespeare-draft", minutes=8.0, hidden_size=128, layers=2, heads=4, kv_heads=2,
                  intermediate_size=344, tokenizer_from="models/tiny-shakespeare"),
}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(train_text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())  # no unk token needed: the byte alphabet covers everything
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds nothing
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Feed line-sized chunks (keeping the "\n") so training is deterministic and cheap.
    lines = train_text.splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def wrap_tokenizer(tok, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,  # keep decode exact
        model_max_length=model_max_length,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, seq_len: int, batch_size: int, max_windows: int | None = None):
    """Mean NLL (nats) over the tokens of ``tokens[1:]``, each predicted exactly once.

    Windows of seq_len+1 tokens with stride seq_len: inputs tokens[i:i+L], targets
    tokens[i+1:i+L+1].  Returns (sum_nll, n_tokens, per-target-token ids for char counting).
    """
    model.eval()
    n = tokens.numel()
    starts = list(range(0, n - 1, seq_len))
    if max_windows is not None:
        starts = starts[:max_windows]
    total_nll = 0.0
    total_tok = 0
    target_ids = []
    for b in range(0, len(starts), batch_size):
        chunk = starts[b:b + batch_size]
        # Windows can differ in length only at the end; evaluate the ragged last one alone.
        full = [s for s in chunk if s + seq_len + 1 <= n]
        rest = [s for s in chunk if s + seq_len + 1 > n]
        groups = ([full] if full else []) + [[s] for s in rest]
        for group in groups:
            x = torch.stack([tokens[s:min(s + seq_len, n - 1)] for s in group])
            y = torch.stack([tokens[s + 1:min(s + seq_len + 1, n)] for s in group])
            logits = model(input_ids=x).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
            total_nll += nll.item()
            total_tok += y.numel()
            target_ids.append(y.reshape(-1))
    model.train()
    return total_nll, total_tok, torch.cat(target_ids)


def chars_of(ids: torch.Tensor, token_nchars: torch.Tensor) -> int:
    return int(token_nchars[ids].sum().item())


# --------------------------------------------------------------------------- model card
def human_params(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def write_model_card(out: Path, info: dict) -> None:
    ln2 = math.log(2)
    card = f"""---
license: mit
language: en
library_name: transformers
pipeline_tag: text-generation
tags: [llama, tiny, shakespeare, pagedllm]
---

# tiny-shakespeare ({human_params(info['n_params'])} parameter Llama)

pagedllm's small embedded default model: a {info['n_layers']}-layer Llama-architecture causal
LM trained from scratch, on CPU, for {info['train_minutes']:.1f} minutes on the tiny-shakespeare
corpus. It is meant for tests, demos and benchmarks of the inference engine that must run
offline; it writes Shakespeare-shaped text (speaker names in capitals followed by a colon,
then verse lines) but it is not a useful assistant.

## Data

`data/tinyshakespeare.txt` in the pagedllm repository: the "tiny shakespeare" corpus
(1,115,394 characters of public-domain Shakespeare plays) as published in the MIT-licensed
karpathy/char-rnn repository (`data/tinyshakespeare/input.txt`).

Split by position: the first 90% of the characters ({info['train_chars']:,} chars,
{info['train_tokens']:,} tokens) is the training set, the last 10% ({info['val_chars']:,}
chars, {info['val_tokens']:,} tokens) the validation set. The tokenizer was trained on the
training set only.

## Tokenizer

Byte-level BPE (`tokenizers`), {info['vocab_size']} entries, trained on the training split.
Special tokens: `<s>` (bos, id {info['bos_id']}), `</s>` (eos, id {info['eos_id']}),
`<pad>` (id {info['pad_id']}). Pre-tokenizer `ByteLevel(add_prefix_space=False)` and a
`ByteLevel` decoder, so `decode(encode(text)) == text` exactly for any string. Encoding does
**not** add `<s>`/`</s>` automatically.

The training text is one raw token stream (`<s>` once at the very start, no `</s>`), so
the model never learned to emit `</s>`: generation runs until `max_tokens`/stop strings
(a blank line `"\\n\\n"` ends a speech).

Chat template (renders with `tokenizer.apply_chat_template`): a `system` message is a
free-standing first paragraph; every other message becomes
`"<NAME or ROLE upper-cased>:\\n<content>\\n\\n"`; `add_generation_prompt=True` appends
`"ASSISTANT:\\n"`, i.e. the conversation is laid out like a scene of the play.

## Architecture

`LlamaForCausalLM`: hidden size {info['hidden_size']}, {info['n_layers']} layers,
{info['n_heads']} attention heads, {info['n_kv_heads']} KV heads (GQA), head dim
{info['head_dim']}, SwiGLU MLP with intermediate size {info['intermediate_size']}, RMSNorm,
RoPE (theta {info['rope_theta']:g}), max position embeddings {info['max_pos']},
tied input/output embeddings: {info['tie']}. Parameters: {info['n_params']:,}.
Weights stored in {info['save_dtype']} (`model.safetensors`).

## Training

```
{info['command']}
```

Plain PyTorch loop, fp32, {info['threads']} CPU threads, seed {info['seed']}. AdamW
(betas 0.9/0.95, weight decay {info['weight_decay']} on matrices), peak LR {info['lr']:g} with
{info['warmup_steps']} linear warm-up steps, then cosine decay to {info['min_lr']:g}
{info['schedule']}; gradient clipping {info['grad_clip']}. Batches: {info['batch_size']} random
windows of {info['seq_len']} tokens from the training stream.

- optimizer steps run: {info['steps']}; tokens seen: {info['tokens_seen']:,}
  (~{info['epochs']:.2f} epochs of the training split); LR at the last step: {info['final_lr']:.2e}
- training wall time: {info['train_seconds']:.0f} s (budget {info['budget_minutes']:g} min) on a
  shared 2-core CPU machine (mean {info['train_seconds'] / max(1, info['steps']):.2f} s/step)
- final training loss (mean of last 20 steps): {info['final_train_loss']:.4f} nats/token

The run is seeded (data order, initialisation, sampling), but with the default time-based
schedule the exact learning rate at each step depends on the machine's speed. For a run
that does not depend on timing, pass `--max-steps N` (e.g. `--max-steps {info['steps']}`
with a `--minutes` large enough); bit-exact weights additionally need the same torch
version and thread count.

## Validation loss

Measured on the whole validation split ({info['val_pred_tokens']:,} predicted tokens,
{info['val_pred_chars']:,} characters), context windows of {info['seq_len']} tokens, each token
predicted once:

| metric | value |
|---|---|
| loss per token | {info['val_nats_tok']:.4f} nats ({info['val_nats_tok'] / ln2:.4f} bits) |
| loss per character | {info['val_nats_char']:.4f} nats ({info['val_nats_char'] / ln2:.4f} bits) |
| perplexity per token | {math.exp(info['val_nats_tok']):.2f} |

(Per-character loss = total validation NLL in nats / number of characters of the predicted
tokens; the corpus is ASCII so characters = bytes.)

## Sample

`model.generate` from the prompt `"ROMEO:"`, temperature 0.8, top-k off, top-p off,
{info['sample_tokens']} new tokens, `torch.manual_seed({info['seed']})`:

```
{info['sample']}
```

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("models/tiny-shakespeare")
model = AutoModelForCausalLM.from_pretrained("models/tiny-shakespeare")
ids = tok("ROMEO:\\n", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=100, do_sample=True, temperature=0.8)
print(tok.decode(out[0]))
```

## License

Weights and tokenizer: MIT (same as the pagedllm repository); training text: public domain
(via the MIT-licensed karpathy/char-rnn repository).
"""
    (out / "README.md").write_text(card, encoding="utf-8")


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(args.out)
    if not out.is_absolute():
        out = Path.cwd() / out
    text = Path(args.data).read_text(encoding="utf-8")
    split = int(0.9 * len(text))
    train_text, val_text = text[:split], text[split:]
    print(f"corpus: {len(text):,} chars -> train {len(train_text):,} / val {len(val_text):,}", flush=True)

    # ---- tokenizer
    t0 = time.time()
    if args.tokenizer_from:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.tokenizer_from) / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_text, args.vocab_size)
    hf_tok = wrap_tokenizer(tok, args.max_position_embeddings)
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS, EOS, PAD))
    vocab_size = tok.get_vocab_size()
    assert tok.decode(tok.encode(val_text[:5000]).ids) == val_text[:5000]
    train_ids = torch.tensor([bos_id] + tok.encode(train_text).ids, dtype=torch.long)
    val_ids = torch.tensor(tok.encode(val_text).ids, dtype=torch.long)
    # number of characters each token decodes to (ASCII corpus: bytes == chars)
    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
    token_nchars = torch.zeros(vocab_size, dtype=torch.long)
    for t, i in tok.get_vocab().items():
        if t not in (BOS, EOS, PAD):
            token_nchars[i] = len(bytes(byte_decoder[c] for c in t))
    assert chars_of(val_ids, token_nchars) == len(val_text.encode("utf-8"))
    print(f"tokenizer: vocab {vocab_size}, bos={bos_id} eos={eos_id} pad={pad_id}; "
          f"train {train_ids.numel():,} tokens, val {val_ids.numel():,} tokens "
          f"({len(train_text) / (train_ids.numel() - 1):.2f} chars/token) [{time.time() - t0:.1f}s]", flush=True)

    # ---- model
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        hidden_act="silu",
        max_position_embeddings=args.max_position_embeddings,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({args.layers}x{args.hidden_size}, "
          f"{args.heads} heads / {args.kv_heads} kv heads, ffn {args.intermediate_size})", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    gen = torch.Generator().manual_seed(args.seed)
    n_train = train_ids.numel()
    L, B = args.seq_len, args.batch_size

    def get_batch():
        ix = torch.randint(0, n_train - L - 1, (B,), generator=gen)
        x = torch.stack([train_ids[i:i + L] for i in ix.tolist()])
        y = torch.stack([train_ids[i + 1:i + L + 1] for i in ix.tolist()])
        return x, y

    budget = args.minutes * 60.0
    quick_eval_windows = 32
    losses: list[float] = []
    warmup_end_t: float | None = None  # seconds into training when warm-up finished

    def lr_at(step: int, elapsed: float) -> float:
        """Linear warm-up over steps, then cosine decay to --min-lr.

        With --max-steps the decay runs over steps (reproducible).  Otherwise it runs over
        the remaining wall-clock budget, so the schedule always completes inside --minutes
        even when the (shared) machine changes speed during the run.
        """
        if step < args.warmup_steps:
            return args.lr * (step + 1) / args.warmup_steps
        if args.max_steps is not None:
            progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        else:
            start = warmup_end_t if warmup_end_t is not None else elapsed
            progress = (elapsed - start) / max(1e-9, budget - start)
        progress = min(1.0, max(0.0, progress))
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1.0 + math.cos(math.pi * progress))

    t_train = time.time()
    step = 0
    lr = 0.0
    while True:
        if args.max_steps is not None and step >= args.max_steps:
            break
        elapsed = time.time() - t_train
        if elapsed >= budget:
            print(f"time budget reached after {step} steps", flush=True)
            break
        if step == args.warmup_steps and warmup_end_t is None:
            warmup_end_t = elapsed
        lr = lr_at(step, elapsed)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = get_batch()
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        losses.append(loss.item())
        step += 1

        if step % 10 == 0 or step == 1:
            el = time.time() - t_train
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {lr:.2e}  {el:6.0f}s "
                  f"({el / step:.2f} s/step)", flush=True)
        if args.eval_every and step % args.eval_every == 0:
            nll, ntok, tgt = evaluate(model, val_ids, L, B, max_windows=quick_eval_windows)
            print(f"  [val subset] {nll / ntok:.4f} nats/token, "
                  f"{nll / chars_of(tgt, token_nchars):.4f} nats/char", flush=True)

    train_seconds = time.time() - t_train
    steps = step
    if args.max_steps is not None:
        schedule = f"over {args.max_steps} steps (`--max-steps`)"
    else:
        schedule = (f"over the remaining wall-clock budget ({args.minutes:g} min; decay progress = "
                    f"elapsed time / budget, so it completes however fast the machine is)")

    # ---- final evaluation on the whole validation split
    t0 = time.time()
    nll, ntok, tgt = evaluate(model, val_ids, L, B)
    nchar = chars_of(tgt, token_nchars)
    val_tok, val_char = nll / ntok, nll / nchar
    print(f"validation (full, {ntok:,} tokens / {nchar:,} chars): "
          f"{val_tok:.4f} nats/token ({val_tok / math.log(2):.4f} bits/token), "
          f"{val_char:.4f} nats/char ({val_char / math.log(2):.4f} bits/char) [{time.time() - t0:.1f}s]",
          flush=True)

    # ---- save
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        do_sample=True, temperature=0.8, max_new_tokens=256)
    save_dtype = torch.float32
    if n_params * 4 > 28 * 1024 * 1024:  # keep the directory small
        save_dtype = torch.bfloat16
        model.to(save_dtype)
    model.save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    # Also spell out the classic (transformers 4.x) keys next to the 5.x ones so that older
    # transformers versions and hand-written config readers see the same values.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("torch_dtype", cfg.get("dtype", str(save_dtype).replace("torch.", "")))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # tokenizer_config.json carries the chat template (read by transformers 4.x and simple
    # loaders); chat_template.jinja is the same template in the transformers >= 4.50 layout.
    hf_tok.save_pretrained(out, save_jinja_files=False)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = CHAT_TEMPLATE
    tc["clean_up_tokenization_spaces"] = False
    tc["add_bos_token"] = False
    tc["add_eos_token"] = False
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    if not (out / "special_tokens_map.json").exists():
        (out / "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")

    # ---- sample (HF generate) from "ROMEO:"
    torch.manual_seed(args.seed)
    prompt = "ROMEO:"
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        gen_out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8,
                                 top_k=0, top_p=1.0, max_new_tokens=args.sample_tokens,
                                 pad_token_id=pad_id)
    sample = hf_tok.decode(gen_out[0], skip_special_tokens=False)
    print("---- sample (T=0.8) ----\n" + sample + "\n------------------------", flush=True)

    cmd = "python scripts/train_default_model.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    tail = losses[-20:]
    info = dict(
        n_params=n_params, n_layers=args.layers, hidden_size=args.hidden_size, n_heads=args.heads,
        n_kv_heads=args.kv_heads, head_dim=args.hidden_size // args.heads,
        intermediate_size=args.intermediate_size, rope_theta=10000.0,
        max_pos=args.max_position_embeddings, tie=True, save_dtype=str(save_dtype).replace("torch.", ""),
        vocab_size=vocab_size, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
        train_chars=len(train_text), val_chars=len(val_text),
        train_tokens=train_ids.numel(), val_tokens=val_ids.numel(),
        command=cmd, threads=args.threads, seed=args.seed, weight_decay=args.weight_decay, lr=args.lr,
        min_lr=args.min_lr, warmup_steps=args.warmup_steps, final_lr=lr,
        schedule=schedule,
        grad_clip=args.grad_clip, batch_size=B, seq_len=L, steps=steps, tokens_seen=steps * B * L,
        epochs=steps * B * L / train_ids.numel(), train_seconds=train_seconds,
        train_minutes=train_seconds / 60, budget_minutes=args.minutes,
        final_train_loss=sum(tail) / max(1, len(tail)),
        val_pred_tokens=ntok, val_pred_chars=nchar, val_nats_tok=val_tok, val_nats_char=val_char,
        sample=sample, sample_tokens=args.sample_tokens,
    )
    write_model_card(out, info)
    (out / "training_summary.json").write_text(json.dumps(
        {k: v for k, v in info.items() if k != "sample"}, indent=2) + "\n")

    for f in out.iterdir():  # some writers use private temp files (0600); make them readable
        if f.is_file():
            os.chmod(f, 0o644)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved to {out} ({size / 1e6:.1f} MB); total script time {time.time() - t_start:.0f}s", flush=True)
    return 0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode mapping used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


if __name__ == "__main__":
    sys.exit(main())
