"""/metrics of a multi-model server: every loaded model server's families (each sample carries
that model's ``model_name``), then the front's own, per model: its state, the memory it holds,
requests in flight and waiting, loads, load failures, unloads by reason and load durations."""
from __future__ import annotations

import asyncio
from typing import Optional

from pagedllm.entrypoints.multi_model.manager import ModelState
from pagedllm.entrypoints.router.metrics import _escape, merge_backend_metrics

PREFIX = "pagedllm"
LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


def _model_label(name: str) -> str:
    return f'model_name="{_escape(name)}"'


def front_metrics(manager) -> str:
    models = list(manager.models.values())
    out: list[str] = []

    def family(name: str, kind: str, doc: str, rows: list[tuple[str, float]]) -> None:
        out.extend([f"# HELP {PREFIX}:{name} {doc}", f"# TYPE {PREFIX}:{name} {kind}"])
        suffix = "_total" if kind == "counter" else ""
        out.extend(f"{PREFIX}:{name}{suffix}{{{labels}}} {value:g}" for labels, value in rows)

    family("model_loaded", "gauge", "1 while the model is loaded and serving.",
           [(_model_label(m.name), int(m.state is ModelState.LOADED)) for m in models])
    family("model_state", "gauge", "The model's state (1 for the state it is in).",
           [(f'{_model_label(m.name)},state="{s.value}"', int(m.state is s)) for m in models for s in ModelState])
    family("model_memory_bytes", "gauge", "Memory the model's server processes hold now (PSS).",
           [(_model_label(m.name), m.memory_bytes) for m in models])
    family("model_footprint_bytes", "gauge", "Memory counted against the budget for the model while it is "
           "loaded: the larger of its estimate and the most it was measured to hold.",
           [(_model_label(m.name), m.footprint(manager.runtime_bytes)) for m in models])
    family("model_requests_in_flight", "gauge", "Requests passed to the model's server and not yet answered.",
           [(_model_label(m.name), m.in_flight) for m in models])
    family("model_requests_waiting", "gauge", "Requests waiting for the model to be loaded.",
           [(_model_label(m.name), m.waiting) for m in models])
    family("model_loads", "counter", "Loads of the model that ended ready.",
           [(_model_label(m.name), m.loads) for m in models])
    family("model_load_failures", "counter", "Loads of the model that failed.",
           [(_model_label(m.name), m.load_failures) for m in models])
    family("model_unloads", "counter", "Unloads of the model, by reason (idle, memory, exited).",
           [(f'{_model_label(m.name)},reason="{r}"', m.unloads.get(r, 0)) for m in models
            for r in ("idle", "memory", "exited")])
    name = f"{PREFIX}:model_load_seconds"
    out.extend([f"# HELP {name} Time from starting a model's server to its first /health 200.",
                f"# TYPE {name} histogram"])
    for m in models:
        lbl = _model_label(m.name)
        for b in LOAD_BUCKETS:
            out.append(f'{name}_bucket{{{lbl},le="{b:g}"}} {sum(1 for s in m.load_seconds if s <= b)}')
        out.append(f'{name}_bucket{{{lbl},le="+Inf"}} {len(m.load_seconds)}')
        out.append(f"{name}_count{{{lbl}}} {len(m.load_seconds)}")
        out.append(f"{name}_sum{{{lbl}}} {sum(m.load_seconds):g}")
    for gauge, doc, value in (("models_memory_budget_bytes", "The memory the loaded models may hold together.",
                               manager.settings.memory_budget),
                              ("models_memory_bytes", "Memory the loaded models hold together now (PSS).",
                               manager.measured_total()),
                              ("models_memory_peak_bytes", "The most the loaded models were measured to hold "
                                                          "together.", manager.peak_total)):
        out.extend([f"# HELP {PREFIX}:{gauge} {doc}", f"# TYPE {PREFIX}:{gauge} gauge", f"{PREFIX}:{gauge} {value}"])
    return "\n".join(out) + "\n"


async def gather_metrics(state) -> str:
    async def one(m) -> Optional[str]:
        if m.state is not ModelState.LOADED or m.url is None:
            return None
        try:
            resp = await state.client.get(f"{m.url}/metrics", timeout=5.0)
            return resp.text if resp.status_code == 200 else None
        except Exception:  # noqa: BLE001 (a model going away has no metrics now)
            return None

    texts = await asyncio.gather(*(one(m) for m in state.manager.models.values()))
    return merge_backend_metrics(texts, label=None) + front_metrics(state.manager)
