"""deploy/kubernetes: every manifest validates against the Kubernetes schemas (kubernetes-validate
ships them, so this runs offline), strictly (no unknown fields), for the oldest and newest
versions it knows; and the Deployment keeps its promises (probes on /health, --cpu-threads equal
to the CPU request, a grace period longer than the drain, the image's non-root user)."""
from __future__ import annotations

import glob
import os
import re

import pytest

yaml = pytest.importorskip("yaml")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MANIFESTS = sorted(glob.glob(os.path.join(REPO, "deploy", "kubernetes", "**", "*.yaml"), recursive=True))


def _docs(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _resources() -> dict[str, dict]:
    out = {}
    for path in MANIFESTS:
        for d in _docs(path):
            out[d["kind"]] = d
    return out


def _kv():
    try:
        from kubernetes_validate import utils
    except ImportError:
        pytest.skip("kubernetes-validate not installed (pip install kubernetes-validate, in the dev extra)")
    return utils


def test_manifests_found():
    assert {os.path.relpath(p, REPO) for p in MANIFESTS} >= {
        "deploy/kubernetes/deployment.yaml", "deploy/kubernetes/service.yaml",
        "deploy/kubernetes/autoscaling/hpa.yaml"}
    assert set(_resources()) == {"Deployment", "Service", "HorizontalPodAutoscaler"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: os.path.relpath(p, REPO))
def test_manifest_validates_against_the_kubernetes_schemas(path):
    kv = _kv()
    versions = kv.all_versions()
    for version in (versions[0], versions[-1]):
        for doc in _docs(path):
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{os.path.relpath(path, REPO)} {doc['kind']} against {version}: "
                            f"{'.'.join(map(str, e.path))}: {e.message}")


def test_the_validator_rejects_a_broken_manifest():
    """The check above is not vacuous: a wrong type and an unknown field are caught."""
    kv = _kv()
    dep = _resources()["Deployment"]
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eighty"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)


def _container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from the container args {args}"
    return args[args.index(name) + 1]


def test_deployment_probes_resources_threads_and_drain():
    res = _resources()
    dep = res["Deployment"]
    c = _container(dep)
    port = next(p for p in c["ports"] if p["name"] == "http")
    assert port["containerPort"] == int(_flag(c["args"], "--port"))
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # Torch threads match the CPU the pod is given (whole CPUs, requests == limits).
    cpu = c["resources"]["requests"]["cpu"]
    assert re.fullmatch(r"\d+", str(cpu)), "whole CPUs, so --cpu-threads can equal them"
    assert c["resources"]["limits"]["cpu"] == cpu
    assert int(_flag(c["args"], "--cpu-threads")) == int(cpu)
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
    # The grace period covers preStop + --shutdown-timeout + uvicorn's 5 s to send the last answers.
    spec = dep["spec"]["template"]["spec"]
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert spec["terminationGracePeriodSeconds"] > pre_stop + float(_flag(c["args"], "--shutdown-timeout")) + 5
    # The image's user (deploy/Dockerfile USER) and a read-only root with writable scratch.
    with open(os.path.join(REPO, "deploy", "Dockerfile")) as f:
        user = re.findall(r"^USER (\d+):(\d+)", f.read(), re.M)[-1]
    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] and (str(sc["runAsUser"]), str(sc["runAsGroup"])) == user
    assert c["securityContext"]["readOnlyRootFilesystem"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/tmp", "/home/pagedllm"} <= mounts
    # The Service and the Prometheus annotations reach the same port.
    svc = res["Service"]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port["containerPort"])


def test_hpa_scales_the_deployment_on_the_adapter_renamed_queue_metric():
    res = _resources()
    hpa = res["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == res["Deployment"]["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    with open(os.path.join(REPO, "deploy", "prometheus-adapter-values.yaml")) as f:
        (rule,) = yaml.safe_load(f)["rules"]["custom"]
    series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
    assert series == "pagedllm:num_requests_waiting"
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert renamed == name
