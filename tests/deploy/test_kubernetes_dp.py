"""deploy/kubernetes-dp: the data-parallel replicas (StatefulSet + headless Service) and the
router (Deployment + Service) validate strictly against the Kubernetes schemas, and agree with
each other: the router's --backends are exactly the StatefulSet's pod DNS names, block sizes and
served model names match, and the router's flags parse with ``pagedllm router``."""
from __future__ import annotations

import glob
import os

import pytest

yaml = pytest.importorskip("yaml")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MANIFESTS = sorted(glob.glob(os.path.join(REPO, "deploy", "kubernetes-dp", "*.yaml")))


def _docs() -> dict[tuple[str, str], dict]:
    out = {}
    for path in MANIFESTS:
        with open(path) as f:
            for d in yaml.safe_load_all(f):
                if d:
                    out[(d["kind"], d["metadata"]["name"])] = d
    return out


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_manifests_validate_against_the_kubernetes_schemas():
    try:
        from kubernetes_validate import utils as kv
    except ImportError:
        pytest.skip("kubernetes-validate not installed (in the dev extra)")
    docs = _docs()
    assert set(docs) == {("Service", "pagedllm-replica"), ("StatefulSet", "pagedllm-replica"),
                         ("Service", "pagedllm"), ("Deployment", "pagedllm-router")}
    versions = kv.all_versions()
    for version in (versions[0], versions[-1]):
        for (kind, name), doc in docs.items():
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{kind}/{name} against {version}: {'.'.join(map(str, e.path))}: {e.message}")


def test_router_fronts_exactly_the_statefulset_replicas():
    docs = _docs()
    sts = docs[("StatefulSet", "pagedllm-replica")]
    headless = docs[("Service", "pagedllm-replica")]
    (router,) = docs[("Deployment", "pagedllm-router")]["spec"]["template"]["spec"]["containers"]
    (replica,) = sts["spec"]["template"]["spec"]["containers"]
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    port = replica["ports"][0]["containerPort"]
    want = [f"http://{sts['metadata']['name']}-{i}.{headless['metadata']['name']}:{port}"
            for i in range(sts["spec"]["replicas"])]
    args = router["args"]
    i = args.index("--backends") + 1
    backends = []
    while i < len(args) and not args[i].startswith("--"):
        backends.append(args[i])
        i += 1
    assert backends == want
    assert _flag(args, "--block-size") == _flag(replica["args"], "--block-size")
    assert _flag(args, "--served-model-name") == _flag(replica["args"], "--served-model-name")
    assert router["command"] == ["pagedllm", "router"]
    router_svc = docs[("Service", "pagedllm")]
    pod_labels = docs[("Deployment", "pagedllm-router")]["spec"]["template"]["metadata"]["labels"]
    assert router_svc["spec"]["selector"].items() <= pod_labels.items()
    from pagedllm.entrypoints.cli import _build_parser

    parsed = _build_parser().parse_args(["router", *args])
    assert parsed.backends == want and parsed.block_size == 16
