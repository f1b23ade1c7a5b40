"""/v1/models before the engine is ready already reports the max_model_len it is loading with."""
from fastapi.testclient import TestClient

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.api_server import build_app


def _cards(config: EngineConfig) -> list[dict]:
    client = TestClient(build_app(config))  # no lifespan: the engine never starts loading
    return client.get("/v1/models").json()["data"]


def test_max_model_len_is_reported_while_loading(llama_ckpt):
    import json
    import os

    with open(os.path.join(llama_ckpt, "config.json")) as f:
        context = json.load(f)["max_position_embeddings"]
    (card,) = _cards(EngineConfig(model=llama_ckpt))
    assert card["max_model_len"] == context
    (card,) = _cards(EngineConfig(model=llama_ckpt, max_model_len=64))
    assert card["max_model_len"] == 64
