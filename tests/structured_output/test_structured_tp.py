"""Structured outputs under tensor parallelism: rank 0 samples, so it applies the masks; 2 ranks
give the same constrained tokens as 1 (greedy and seeded), and every output validates."""
import json
import os

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams as S  # noqa: E402

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")

SCHEMA = {"type": "object", "properties": {"who": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["who", "n"], "additionalProperties": False}


def run(path, tp):
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=16 << 20, max_model_len=256)
    try:
        params = [SamplingParams(max_tokens=60, temperature=t, seed=s, structured_outputs=S(json=SCHEMA))
                  for t, s in ((0.0, None), (1.0, 3))]
        params.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))  # a free neighbour
        outs = llm.generate(["ROMEO:", "KING:", "First Citizen:"], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_tp2_masks_like_tp1(default_model):
    one, two = run(default_model, 1), run(default_model, 2)
    assert one == two
    for ids, text, reason in one[:2]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
