"""deploy/: the Kubernetes manifests parse and agree with each other and with the server (probe path,
ports, labels the router discovers, the metric the autoscaler reads), and the images run
`edgellm serve` on every interface as a non-root user. Nothing is built or applied here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
HELM_VALUES = "prometheus-adapter-values.yaml"


def _manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, from every Kubernetes manifest under deploy/k8s."""
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name in (HELM_VALUES, "kustomization.yaml"):
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{path.name}: {doc}"
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


def _port(container: dict[str, Any], ref: int | str) -> int:
    """A probe's or a Service's port (a number or a container port's name) as a number."""
    if isinstance(ref, int):
        return ref
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == ref)


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", HELM_VALUES}
    assert set(listed) == present


def test_replicas_are_probed_on_health_and_served_by_their_service():
    m = _manifests()
    deployment, service = m[("Deployment", "edgellm")], m[("Service", "edgellm")]
    container = _container(deployment)
    http = _port(container, "http")
    assert http == 8000
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
        assert _port(container, container[probe]["httpGet"]["port"]) == http, probe
    # a loading replica answers 503 for minutes: only the startup probe may wait that long
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert deployment["spec"]["selector"]["matchLabels"].items() <= _labels(deployment).items()
    assert service["spec"]["selector"].items() <= _labels(deployment).items()
    (port,) = service["spec"]["ports"]
    assert _port(container, port["targetPort"]) == http
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics" and int(annotations["prometheus.io/port"]) == http


def _flag(args: list[str], name: str) -> list[str]:
    """The values of `--name=value` or `--name v1 v2 ...` in a container's args."""
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            return [arg.split("=", 1)[1]]
        if arg == name:
            rest = args[i + 1:]
            return rest[:next((j for j, a in enumerate(rest) if a.startswith("--")), len(rest))]
    return []


def test_router_discovers_exactly_the_replicas_and_its_service_reaches_it():
    m = _manifests()
    replicas, router = m[("Deployment", "edgellm")], m[("Deployment", "edgellm-router")]
    args = _container(router)["args"]
    selector = dict(s.split("=", 1) for s in _flag(args, "--selector"))
    assert selector and selector.items() <= _labels(replicas).items()
    assert not selector.items() <= _labels(router).items()  # the router never routes to itself
    assert int(_flag(args, "--service-discovery-port")[0]) == _port(_container(replicas), "http")
    assert _flag(args, "--service-discovery-namespace") == [replicas["metadata"]["namespace"]]
    assert _flag(args, "--policy") == ["cache_aware"]
    service = m[("Service", "edgellm-router")]
    assert service["spec"]["selector"].items() <= _labels(router).items()
    (port,) = service["spec"]["ports"]
    assert _port(_container(router), port["targetPort"]) == int(_flag(args, "--port")[0])
    role = m[("Role", "edgellm-router")]
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]
    assert m[("RoleBinding", "edgellm-router")]["subjects"][0]["name"] == router["spec"]["template"]["spec"][
        "serviceAccountName"]


def test_autoscaler_reads_the_waiting_requests_gauge_the_server_exports():
    m = _manifests()
    hpa = m[("HorizontalPodAutoscaler", "edgellm")]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    assert (hpa["spec"]["scaleTargetRef"]["name"]) in {name for kind, name in m if kind == "Deployment"}
    (metric,) = hpa["spec"]["metrics"]
    rules = yaml.safe_load((K8S / HELM_VALUES).read_text())["rules"]["custom"]
    (rule,) = [r for r in rules if r["name"]["as"] == metric["pods"]["metric"]["name"]]
    series = rule["seriesQuery"].split("{")[0]
    assert series == "vllm:num_requests_waiting"
    assert re.fullmatch(rule["name"]["matches"], series)
    assert f'"{series}"' in (ROOT / "edgellm" / "server" / "metrics.py").read_text()


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_images_serve_on_every_interface_as_a_non_root_user():
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        steps = _instructions(ROOT / "deploy" / name)
        users = [arg for op, arg in steps if op == "USER"]
        assert users and users[-1] not in ("root", "0"), name
        (entry,) = [arg for op, arg in steps if op == "ENTRYPOINT"]
        assert entry.startswith('["edgellm", "serve", "--host", "0.0.0.0", "--port", "8000"'), name
        runs = [arg for op, arg in steps if op == "RUN"]
        torch_step = next(i for i, r in enumerate(runs) if "torch==" in r)
        package_step = next(i for i, r in enumerate(runs) if "pip install '.[server" in r)
        assert torch_step < package_step, f"{name}: torch must be installed before the package"
    cpu_runs = [arg for op, arg in _instructions(ROOT / "deploy" / "Dockerfile.cpu") if op == "RUN"]
    assert any("torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in r for r in cpu_runs)
