"""/metrics of the router: every backend's Prometheus text merged, plus the router's own counters.

Aggregation choice: each backend sample is kept with an added ``replica`` label (its index in
--backends) instead of being summed: sums lose which replica is hot, and any dashboard can sum
``by`` the other labels (``sum without (replica) (rate(pagedllm:prompt_tokens_total[1m]))``).
Families keep one HELP/TYPE line. A backend that does not answer contributes nothing and shows
as ``pagedllm_router:replica_up{replica="i"} 0``.

Router counters: routed requests per replica, of which routed for a cached prefix (the router's
prefix hit decisions), requests failed for want of a replica, and replica health.
"""
from __future__ import annotations

from typing import Optional, Sequence

from pagedllm.entrypoints.router.replicas import Replica

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "pagedllm_router"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def merge_backend_metrics(texts: Sequence[Optional[str]], label: Optional[str] = "replica") -> str:
    """One exposition text from the backends' texts (None: that replica gave none); each sample
    gets ``label`` = the backend's index (None: no label added; the backends' own labels tell
    them apart)."""
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.utils import floatToGoString

    families: dict[str, dict] = {}  # name -> {"type", "help", "samples": [lines]}
    for i, text in enumerate(texts):
        if not text:
            continue
        for fam in text_string_to_metric_families(text):
            entry = families.setdefault(fam.name, {"type": fam.type, "help": fam.documentation, "samples": []})
            for s in fam.samples:
                labels = {label: str(i), **s.labels} if label else s.labels
                entry["samples"].append(f"{s.name}{_labels(labels)} {floatToGoString(s.value)}")
    out: list[str] = []
    for name, entry in families.items():
        out.append(f"# HELP {name} {entry['help']}".replace("\n", " "))
        out.append(f"# TYPE {name} {entry['type']}")
        out.extend(entry["samples"])
    return "\n".join(out) + ("\n" if out else "")


def router_metrics(replicas: Sequence[Replica], no_replica_failures: int, proxy_errors: int) -> str:
    rows = [
        (f"{PREFIX}:routed_requests", "counter", "Requests sent to each replica.",
         [(r, r.routed) for r in replicas]),
        (f"{PREFIX}:prefix_routed_requests", "counter",
         "Requests sent to a replica because its prefix index held part of the prompt (prefix hit decisions).",
         [(r, r.prefix_routed) for r in replicas]),
        (f"{PREFIX}:requests_in_flight", "gauge", "Requests the router is waiting on, per replica.",
         [(r, r.in_flight) for r in replicas]),
        (f"{PREFIX}:replica_up", "gauge", "1 while the replica answers /health with 200.",
         [(r, int(r.healthy)) for r in replicas]),
        (f"{PREFIX}:prefix_index_blocks", "gauge", "Block hashes in the replica's approximate prefix index.",
         [(r, len(r.prefix)) for r in replicas]),
    ]
    out: list[str] = []
    for name, kind, doc, samples in rows:
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        suffix = "_total" if kind == "counter" else ""
        out += [f'{name}{suffix}{{replica="{r.id}",url="{_escape(r.url)}"}} {v}' for r, v in samples]
    for name, doc, v in ((f"{PREFIX}:no_replica_requests", "Requests refused because no replica was healthy.",
                          no_replica_failures),
                         (f"{PREFIX}:proxy_errors", "Requests that failed between the router and a replica "
                                                    "(answered 502).", proxy_errors)):
        out += [f"# HELP {name} {doc}", f"# TYPE {name} counter", f"{name}_total {v}"]
    return "\n".join(out) + "\n"
