"""generation_config.json defaults: used where a request leaves a field unset, as vLLM does
(``generation_config="vllm"`` ignores them; a directory may supply another file)."""
import json
import os
import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.models.config_json import load_generation_defaults

KW = dict(dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)


def write_gen(d, **values):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(values, f)
    return str(d)


def test_reads_the_sampling_fields_only(tmp_path):
    d = write_gen(tmp_path / "m", temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                  max_new_tokens=32, do_sample=True, eos_token_id=2, bos_token_id=1)
    assert load_generation_defaults(d) == dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                                               repetition_penalty=1.1, max_tokens=32)
    assert load_generation_defaults(d, "vllm") == {}
    other = write_gen(tmp_path / "other", temperature=0.3)
    assert load_generation_defaults(d, other) == {"temperature": 0.3}
    assert load_generation_defaults(str(tmp_path / "none")) == {}  # no file: no defaults


def test_bad_files_name_the_file_and_field(tmp_path):
    d = write_gen(tmp_path / "bad", temperature=-1)
    with pytest.raises(ValueError, match=r"generation_config.json: temperature must be"):
        load_generation_defaults(d)
    (tmp_path / "bad" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        load_generation_defaults(d)
    with pytest.raises(ValueError, match="does not exist"):
        load_generation_defaults(d, str(tmp_path))


def test_default_model_recommends_temperature_0_8(default_model):
    llm = LLM(model=default_model, kv_cache_memory=8 << 20)
    sp = llm.get_default_sampling_params()
    assert sp.temperature == 0.8 and sp.max_tokens == 256 and not sp.is_greedy
    assert LLM(model=default_model, kv_cache_memory=8 << 20, generation_config="vllm").get_default_sampling_params() \
        == SamplingParams()


def test_generate_without_params_uses_the_model_defaults(llama_ckpt, tmp_path):
    path = str(tmp_path / "greedy_model")
    shutil.copytree(llama_ckpt, path)
    write_gen(path, temperature=0.0, max_new_tokens=3, eos_token_id=2)
    llm = LLM(model=path, **KW)
    prompt = [[5, 6, 7, 8]]
    out = llm.generate(prompt_token_ids=prompt, use_tqdm=False)[0].outputs[0]
    ref = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids and len(out.token_ids) <= 3
    ignored = LLM(model=path, generation_config="vllm", **KW).get_default_sampling_params()
    assert ignored.temperature == 1.0 and ignored.max_tokens == 16
