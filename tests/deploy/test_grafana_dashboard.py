"""deploy/grafana/pagedllm-dashboard.json queries only metrics the server exports: the app runs
in-process over a tiny checkpoint, serves one request, and every metric name in the dashboard's
queries (and the HPA adapter rule), with the ``metric_prefix`` variable substituted, is a sample
name in its /metrics -- for the default prefix and for ``--metrics-prefix vllm``."""
from __future__ import annotations

import json
import os
import re
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "pagedllm-dashboard.json")
ADAPTER = os.path.join(REPO, "deploy", "prometheus-adapter-values.yaml")
PREFIX_VARS = ("${metric_prefix}", "$metric_prefix", "[[metric_prefix]]")
# Anything in a query that looks like a metric (name with a ':'), after substitution.
METRIC_RE = re.compile(r"\b([a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+)")


def _dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def _queries(dash: dict) -> list[str]:
    """Every PromQL text: panel targets (rows' nested panels too) and query variables."""
    out = []

    def panels(ps):
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dash["panels"]):
        out += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def _substitute(expr: str, prefix: str) -> str:
    for var in PREFIX_VARS:
        expr = expr.replace(var, prefix)
    return expr


def test_dashboard_takes_the_prefix_as_a_variable():
    dash = _dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["metric_prefix"]["query"] == "pagedllm"  # --metrics-prefix's default
    assert variables["metric_prefix"]["current"]["value"] == "pagedllm"
    assert "datasource" in variables and "model_name" in variables
    queries = _queries(dash)
    assert len(queries) >= 10
    for q in queries:
        # Every metric name is written through the variable, none with a hard-coded prefix.
        assert "${metric_prefix}:" in q, q
        assert METRIC_RE.findall(_substitute(q, "p")), q
        assert not re.search(r"\b(pagedllm|vllm):", q), f"hard-coded prefix in {q}"
    panel_ids = [p["id"] for p in dash["panels"]]
    assert len(panel_ids) == len(set(panel_ids))


def _exported(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return names


@pytest.fixture(scope="module")
def engine(llama_ckpt):
    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_llm import AsyncLLM

    eng = AsyncLLM(EngineConfig(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20, max_model_len=256,
                                seed=0))
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("prefix", ["pagedllm", "vllm"])
def test_dashboard_metrics_are_exported(engine, prefix):
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import ServerArgs, build_app

    app = build_app(engine, served_model_name="tiny", args=ServerArgs(metrics_prefix=prefix))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "w1 w2 w3", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while True:  # the finished request's counters land from the engine thread
            text = client.get("/metrics").text
            if re.search(rf"^{prefix}:generation_tokens_total\{{[^}}]*\}} [1-9]", text, re.M) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    exported = _exported(text)
    assert f"{prefix}:num_requests_running" in exported, sorted(exported)[:20]
    wanted = {}
    for q in _queries(_dashboard()):
        for name in METRIC_RE.findall(_substitute(q, prefix)):
            wanted.setdefault(name, q)
    with open(ADAPTER) as f:
        adapter = f.read().replace("pagedllm:", f"{prefix}:")
    for name in re.findall(r"seriesQuery: '([a-zA-Z_:][a-zA-Z0-9_:]*)", adapter):
        wanted.setdefault(name, "prometheus-adapter seriesQuery")
    missing = {name: q for name, q in wanted.items() if name not in exported}
    assert not missing, f"queried but not exported: {missing}"
    # Labels the queries select or group by exist on the exported series.
    labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)=\"", text))
    for q in wanted.values():
        for label in re.findall(r"\b(?:by|without) \(([^)]*)\)", q):
            for lbl in label.split(","):
                assert lbl.strip() in labels, (lbl, q)
        for lbl in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)=~?\"", q):
            assert lbl in labels, (lbl, q)
