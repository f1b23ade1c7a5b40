"""What the draft-model and EAGLE engine tests share: a speculative config with the governor off
(its timing-driven plain steps would make draft counts vary), and a run that returns the greedy
tokens and stats after checking that every block went back and the pool is consistent."""
from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def spec_config(method: str, model: str, k: int = 3, **kw) -> dict:
    return {"method": method, "model": model, "num_speculative_tokens": k, "auto_disable": False, **kw}


def run(path, prompts, params=GREEDY, speculative_config=None, **kw):
    kw.setdefault("kv_cache_memory", 16 << 20)
    llm = LLM(model=path, dtype="float32", speculative_config=speculative_config, **kw)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    s = llm.get_stats()
    assert s.num_free_blocks == s.num_total_blocks
    llm.engine.core.kv_cache_manager.pool.check_consistency()
    return [o.outputs[0].token_ids for o in outs], s
