"""LLaVA (issue 34): our CLIP tower + projector + Llama against HF transformers' float32
LlavaForConditionalGeneration on a tiny random checkpoint: pixel values equal to HF's image
processor, greedy tokens identical for 1-2 images of different sizes and modes mixed in one batch
with a text-only prompt, under chunked prefill that splits images (block size 4), prefix caching on
and off; the prefix cache
hits for the same image (also stopping inside one) and misses from the first block a different
image touches; LLM.chat's image_url parts; bad images refused naming the field; no leaked blocks."""
from __future__ import annotations

import base64
import io
import os

import numpy as np
import pytest

from llava_checkpoints import IMAGE_TOKEN, NUM_IMAGE_TOKENS, hf_llava_greedy, make_llava_checkpoint, sample_images
from pagedllm import LLM, SamplingParams

NEW = 8
SP = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def llava(ckpt_dir):
    path = make_llava_checkpoint(str(ckpt_dir / "llava"))
    # block 4 and a 24-token budget: prefill chunks split the 16-position images
    llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=24, kv_cache_memory=4 << 20,
              max_model_len=256, allowed_local_media_path=str(ckpt_dir))
    return path, llm


def expanded(llm, text: str) -> list[int]:
    ids = llm.get_tokenizer().encode(text)
    out = []
    for t in ids:
        out.extend([IMAGE_TOKEN] * NUM_IMAGE_TOKENS if t == IMAGE_TOKEN else [t])
    return out


def assert_idle(llm) -> None:
    kv = llm.engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    assert not llm.engine.core.executor.worker.runner.encoder_cache.outputs


def test_pixel_values_equal_hf_image_processor(llava):
    import transformers as tf

    from pagedllm.multimodal.image_processor import ClipImageProcessor

    path, _ = llava
    ours, hf = ClipImageProcessor.from_dir(path), tf.AutoImageProcessor.from_pretrained(path)
    for img in sample_images():
        ref = hf(images=[img], return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(ours(img), ref, rtol=0, atol=1e-6)


TEXTS = ["w1 w2 w3 w4 w5 <image> w6 w7 w8", "w9 <image> w10 <image> w11", "w1 w2 w3 w4 w5 w6 w7",
         "w1 w2 w3 w4 w5 <image> w6 w7 w8"]


def test_greedy_identity_with_hf_mixed_batch(llava):
    path, llm = llava
    a, b, c = sample_images()
    images = [[a], [b, c], [], [c]]
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in zip(TEXTS, images)]
    outs = llm.generate(prompts, SP, use_tqdm=False)
    ref = hf_llava_greedy(path, [(expanded(llm, t), im) for t, im in zip(TEXTS, images)], NEW)
    assert [list(o.outputs[0].token_ids) for o in outs] == ref
    assert len(outs[0].prompt_token_ids) == 8 + NUM_IMAGE_TOKENS
    assert ref[0] != ref[3]  # the image steers the text (same words, another image)
    assert_idle(llm)
    uncached = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=24, kv_cache_memory=4 << 20,
                   max_model_len=256, enable_prefix_caching=False)
    try:  # prefix caching off: the same tokens
        assert [list(o.outputs[0].token_ids) for o in uncached.generate(prompts, SP, use_tqdm=False)] == ref
    finally:
        uncached.engine.shutdown()


def test_prefix_cache_hits_same_image_misses_another(llava):
    path, llm = llava
    a, b, c = sample_images()
    first = llm.generate({"prompt": TEXTS[0], "multi_modal_data": {"image": a}}, SP, use_tqdm=False)[0]
    again = llm.generate({"prompt": TEXTS[0], "multi_modal_data": {"image": a}}, SP, use_tqdm=False)[0]
    assert again.num_cached_tokens == 20 and again.outputs[0].token_ids == first.outputs[0].token_ids
    cropped = np.asarray(a).copy()
    cropped[0, 0] = 255 - cropped[0, 0]  # a corner the center crop cuts away: the same pixel values, the same KV
    same = llm.generate({"prompt": TEXTS[0], "multi_modal_data": {"image": cropped}}, SP, use_tqdm=False)[0]
    assert same.num_cached_tokens == 20
    other = np.asarray(a).copy()
    other[10, 15, 0] ^= 1  # one pixel's low bit in the middle: another image
    miss = llm.generate({"prompt": TEXTS[0], "multi_modal_data": {"image": other}}, SP, use_tqdm=False)[0]
    assert miss.num_cached_tokens == 4  # block 0 is text; block 1 holds the image's first positions
    # same image, other words after it: the hit ends at position 20, inside the image (its last row is computed)
    text = "w1 w2 w3 w4 w5 <image> w30 w31 w32"
    mid = llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, SP, use_tqdm=False)[0]
    assert mid.num_cached_tokens == 20
    assert list(mid.outputs[0].token_ids) == hf_llava_greedy(path, [(expanded(llm, text), [a])], NEW)[0]
    # a hit past the image's last position: the encoder does not run for it at all
    long = {"prompt": "w1 w2 w3 w4 w5 <image> w6 w7 w8 w9 w10 w11 w12", "multi_modal_data": {"image": a}}
    first = llm.generate(long, SP, use_tqdm=False)[0]
    cache = llm.engine.core.executor.worker.runner.encoder_cache
    encoded = cache.num_encoded
    again = llm.generate(long, SP, use_tqdm=False)[0]
    assert again.num_cached_tokens == 24 and cache.num_encoded == encoded
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_idle(llm)


def test_chat_image_url_parts_equal_generate(llava, ckpt_dir):
    _, llm = llava
    a, b, _ = sample_images()
    b.save(ckpt_dir / "b.png")
    content = [{"type": "text", "text": "w1 w2"}, {"type": "image_url", "image_url": {"url": data_url(a)}},
               {"type": "text", "text": "w3"}, {"type": "image_url", "image_url": {"url": f"file://{ckpt_dir}/b.png"}}]
    chat = llm.chat([{"role": "user", "content": content}], SP, use_tqdm=False)[0]
    gen = llm.generate({"prompt": "user: w1 w2\n<image>\nw3\n<image> assistant:", "multi_modal_data": {"image": [a, b]}},
                       SP, use_tqdm=False)[0]
    assert chat.prompt_token_ids == gen.prompt_token_ids and chat.outputs[0].token_ids == gen.outputs[0].token_ids


def test_chat_images_back_to_back_lose_their_newlines_and_still_count(llava):
    """Three image parts in a row: the template joins them with newlines, the word-level tokenizer
    drops those, and the three placeholder ids in a row are three images (not a refused run)."""
    path, llm = llava
    a, b, c = sample_images()
    content = [{"type": "image_pil", "image_pil": im} for im in (b, c, a)] + [{"type": "text", "text": "w4"}]
    chat = llm.chat([{"role": "user", "content": content}], SP, use_tqdm=False)[0]
    text = "user: <image> <image> <image> w4 assistant:"
    assert chat.prompt_token_ids == expanded(llm, text)
    assert list(chat.outputs[0].token_ids) == hf_llava_greedy(path, [(expanded(llm, text), [b, c, a])], NEW)[0]
    assert_idle(llm)


def test_bad_images_refused_naming_the_field(llava):
    _, llm = llava
    a = sample_images()[0]

    def chat(part):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "w1"}, part]}], SP, use_tqdm=False)

    with pytest.raises(ValueError, match="2 image placeholder.*1 image"):
        llm.generate({"prompt": "w1 <image> w2 <image>", "multi_modal_data": {"image": a}}, SP, use_tqdm=False)
    with pytest.raises(ValueError, match="2 image placeholder.*3 image"):  # adjacent placeholders: adjacent images
        llm.generate({"prompt": "w1 <image> <image>", "multi_modal_data": {"image": [a, a, a]}}, SP, use_tqdm=False)
    with pytest.raises(ValueError, match="1 image placeholder.*0 image"):
        llm.generate("w1 <image> w2", SP, use_tqdm=False)
    with pytest.raises(ValueError, match="unsupported modality 'video'"):
        llm.generate({"prompt": "w1", "multi_modal_data": {"video": a}}, SP, use_tqdm=False)
    with pytest.raises(ValueError, match=r"image 0: a numpy image must be uint8"):
        llm.generate({"prompt": "w1 <image>", "multi_modal_data": {"image": np.zeros((4, 4, 3))}}, SP, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]\.image_url: .*not valid base64"):
        chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}})
    with pytest.raises(ValueError, match=r"content\[1\]\.image_url: .*not a readable image"):
        chat({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"xx").decode()}})
    with pytest.raises(ValueError, match=r"content\[1\]\.image_url: remote image URLs are not fetched"):
        chat({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})
    with pytest.raises(ValueError, match=r"content\[1\]\.image_url: .*outside the server's allowed_local_media_path"):
        chat({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}})
    with pytest.raises(ValueError, match=r"content\[1\]: unsupported content part type 'audio_url'"):
        chat({"type": "audio_url", "audio_url": {"url": "x"}})
    with pytest.raises(ValueError, match=r"17 images, over the limit of 16 a prompt \(limit_mm_per_prompt\)"):
        llm.generate({"prompt": "w1", "multi_modal_data": {"image": [a] * 17}}, SP, use_tqdm=False)
    assert_idle(llm)


def test_text_model_refuses_images_and_the_image_limit():
    from pagedllm.config import EngineConfig
    from pagedllm.engine.input_processor import InputProcessor
    from pagedllm.multimodal.chat_content import ContentError, flatten_content

    with pytest.raises(ValueError, match="multi_modal_data: this model takes no images"):
        InputProcessor(None, 100, 64).process({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": []}})
    with pytest.raises(ContentError, match="this model takes no images"):
        flatten_content([{"type": "image_url", "image_url": {"url": "data:,"}}], None, [], None, "messages[0].content")
    assert EngineConfig(limit_mm_per_prompt='{"image": 2}').max_images_per_prompt == 2
    assert EngineConfig(limit_mm_per_prompt={"image": 0}).max_images_per_prompt == 0
    assert EngineConfig().max_images_per_prompt == 16
    for bad in ('{"video": 1}', '{"image": -1}', "image=2", [2]):
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            EngineConfig(limit_mm_per_prompt=bad)
    img = sample_images()[0]
    parts = [{"type": "image_pil", "image_pil": img}] * 2
    with pytest.raises(ContentError, match=r"messages\[0\]\.content\[1\]\.image_pil: more than 1 images"):
        flatten_content(parts, "<image>", [], None, "messages[0].content", max_images=1)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_pipeline_parallel_puts_the_tower_on_stage_0(llava):
    path, llm = llava
    a, b, _ = sample_images()
    prompts = [{"prompt": TEXTS[0], "multi_modal_data": {"image": a}}, {"prompt": TEXTS[1], "multi_modal_data": {
        "image": [b, a]}}]
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, SP, use_tqdm=False)]
    pp = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=24, kv_cache_memory=4 << 20,
             max_model_len=256, pipeline_parallel_size=2)
    try:
        assert [list(o.outputs[0].token_ids) for o in pp.generate(prompts, SP, use_tqdm=False)] == want
        stats = pp.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        pp.engine.shutdown()
