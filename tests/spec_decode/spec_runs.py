"""What the draft-model and EAGLE engine tests share: a speculative config with the governor off
(its timing-driven plain steps would make draft counts vary), and a run that returns the greedy
tokens and stats after checking that every block went back and the pool is consistent."""
import math
from collections import Counter

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


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: 0.999)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_second_tokens_follow_the_target(pairs, target: str, prompt: list, vocab: int) -> None:
    """``pairs``: (token 1, token 2) of many sampled runs of ``prompt`` on a tiny-vocabulary
    ``target``; token 2 sits at a drafted position. Per first token seen at least 80 times, the
    second's counts must fit p(token 2 | prompt, token 1) from HF (chi-square, cells with an
    expected count under 5 pooled; fixed seeds upstream, so this cannot flake)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        p = torch.softmax(hf(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1].double(), dim=-1)
    stat, df = 0.0, 0
    for t1, count in Counter(t1 for t1, _ in pairs).items():
        if count < 80:
            continue
        seen = Counter(t2 for a, t2 in pairs if a == t1)
        expected = p[t1] * count
        big = [t for t in range(vocab) if expected[t] >= 5]
        small = [t for t in range(vocab) if expected[t] < 5]
        cells = [(seen[t], float(expected[t])) for t in big]
        if small:
            cells.append((sum(seen[t] for t in small), float(expected[small].sum())))
        stat += sum((o - e) ** 2 / e for o, e in cells)
        df += len(cells) - 1
    assert df >= 10
    assert stat < _chi2_critical(df), (stat, df)
