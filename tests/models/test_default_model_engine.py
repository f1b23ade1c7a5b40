"""The embedded default model through pagedllm: identical to HF, real-tokenizer text handling."""
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.tokenizer.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(model=default_model, kv_cache_memory=64 << 20)


def test_default_model_is_the_default(default_model):
    from pagedllm.config import EngineConfig

    assert EngineConfig().model == default_model


def test_greedy_matches_hf(llm, default_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    hf = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    prompts = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak.\n", "O"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                              eos_token_id=None, pad_token_id=2)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref)


def test_sampled_text_is_shakespeare_shaped(llm):
    out = llm.generate(["ROMEO:"], SamplingParams(temperature=0.8, seed=0, max_tokens=150), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert "\n" in text and any(line.rstrip().endswith(":") and line.strip().isupper() for line in text.splitlines())


def test_incremental_detokenization_matches_full_decode(llm):
    tok = llm.get_tokenizer()
    text = "KING:\n  What, ho!  Ça va? — naïve café 日本語 🎭\n\tEnd.\n"
    ids = tok.encode(text)
    prompt = tok.encode("Hello there,")
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.step([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_strings_on_real_text(llm):
    sp = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    full = llm.generate(["ROMEO:"], sp, use_tqdm=False)[0].outputs[0].text
    stop = full[10:14]
    out = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=80, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[: full.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop


def test_chat_uses_the_template(llm):
    msgs = [{"role": "user", "content": "What say you, good sir?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected
    assert out.prompt == expected  # the rendered prompt, as vLLM's LLM.chat gives it
    assert len(out.outputs[0].token_ids) == 20
