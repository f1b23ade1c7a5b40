"""Images and the prefix cache (issue 34): time to first token of a LLaVA request whose image is
new (the vision tower runs, every position is computed), the same image again (its blocks hit the
prefix cache: no encoder run, only the last blocks computed) and a different image of the same
size (misses from the image's first block), alternated over --rounds; the encoder's share of a
new image's prefill. The model is a random-weight LLaVA-1.5-shaped checkpoint built locally
(CLIP at 336 px / 14 px patches -> 576 positions per image; sizes from the flags).

    python benchmarks/vlm_images.py --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_info, print_table, write_json  # noqa: E402


def build(path: str, hidden: int, layers: int, vision_hidden: int, vision_layers: int) -> str:
    import torch
    import transformers as tf

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from llava_checkpoints import IMAGE_TOKEN, VOCAB, _tokenizer

    torch.manual_seed(0)
    text = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                          num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                          max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    vision = tf.CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=vision_hidden * 4,
                                 num_hidden_layers=vision_layers, num_attention_heads=vision_hidden // 64,
                                 image_size=336, patch_size=14)
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    tf.LlavaForConditionalGeneration(cfg).float().save_pretrained(path, safe_serialization=True)
    tf.CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}).save_pretrained(path)
    _tokenizer(path)
    return path


def ttft(llm, prompt, sp) -> float:
    eng = llm.engine
    t = time.perf_counter()
    eng.add_request(None, prompt, sp)
    first = None
    while eng.has_unfinished_requests():
        eng.step()
        if first is None:
            first = time.perf_counter() - t  # the prompt fits one step: its first token
    return first


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "pagedllm-bench-llava"))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vision-hidden", type=int, default=256)
    ap.add_argument("--vision-layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/vlm_images.json")
    args = ap.parse_args()
    import numpy as np
    from PIL import Image

    from pagedllm import LLM, SamplingParams

    path = build(args.model, args.hidden, args.layers, args.vision_hidden, args.vision_layers)
    llm = LLM(model=path, dtype="float32", kv_cache_memory=1 << 30, max_num_batched_tokens=2048)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    # 8 words, the image's 576 positions, 20 words: a repeat's hit (592 tokens) covers the whole image
    text = "w1 w2 w3 w4 w5 w6 w7 w8 <image> " + " ".join(f"w{i}" for i in range(9, 29))

    def prompt(img):
        return {"prompt": text, "multi_modal_data": {"image": img}}

    def image():
        return Image.fromarray(rng.integers(0, 256, (400, 500, 3), dtype=np.uint8))

    runner = llm.engine.core.executor.worker.runner
    pixels = llm.engine.input_processor.images.preprocess(image())[None]
    import torch

    ttft(llm, prompt(image()), sp)  # warm-up
    times = {"new image": [], "same image again": [], "another image": [], "encoder alone": []}
    for _ in range(args.rounds):
        img = image()
        times["new image"].append(ttft(llm, prompt(img), sp))
        times["same image again"].append(ttft(llm, prompt(img), sp))
        times["another image"].append(ttft(llm, prompt(image()), sp))
        t = time.perf_counter()
        with torch.inference_mode():
            runner.model.embed_images(torch.from_numpy(pixels))
        times["encoder alone"].append(time.perf_counter() - t)
    stats = llm.get_stats()
    rows = [{"case": k, "ttft_p50_ms": round(statistics.median(v) * 1e3, 1), "min_ms": round(min(v) * 1e3, 1)}
            for k, v in times.items()]
    print(f"\nLLaVA-shaped: text hidden {args.hidden} x {args.layers} layers, CLIP 336/14 hidden {args.vision_hidden} x "
          f"{args.vision_layers} layers (576 positions an image); {args.rounds} rounds alternated")
    print_table(rows, list(rows[0]))
    hit = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
    print(f"prefix-cache hit rate over the run: {hit:.3f}")
    write_json(args.out, {"args": vars(args), "cpu": cpu_info(), "results": rows, "hit_rate": hit})


if __name__ == "__main__":
    main()
