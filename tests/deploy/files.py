"""Reading deploy/: YAML documents, the Kubernetes objects of deploy/k8s and of the Helm chart rendered
with several values, their pods and containers."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from unittest import mock

import kubernetes_validate
import yaml

from gateway.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CHART = DEPLOY / "helm" / "burstgate"
KUBERNETES_VERSION = "1.30"  # the oldest minor the manifests must be valid for
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def k8s_objects() -> list[dict]:
    """Every object that `kubectl apply -k deploy/k8s` sends, read from the kustomization's resources."""
    kustomization = documents(K8S / "kustomization.yaml")[0]
    return [d for resource in kustomization["resources"] for d in documents(K8S / resource)]


def helm_objects(values: dict | None = None, release: str = "demo") -> list[dict]:
    """The chart rendered offline by Helm's own engine (helm-python-sdk binds Helm v4's Go SDK)."""
    import helm_python

    with helm_python.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values or {}, name=release, namespace="burstgate")
    return [d for name, text in sorted(rendered.items()) if name.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def helm_available() -> bool:
    try:
        import helm_python  # noqa: F401
    except (ImportError, OSError):  # no wheel for this platform, or its library does not load
        return False
    return True


# The manifest sets every Kubernetes check runs over: deploy/k8s, and the chart with its toggles.
HELM_VALUES = {
    "helm-default": {},
    "helm-gpu": {"vllm": {"enabled": True}, "tgi": {"enabled": True}, "apiKeys": {"existingSecret": "burstgate-keys"}},
    "helm-fixed-replicas": {"gateway": {"autoscaling": {"enabled": False}}, "redis": {"enabled": False},
                            "apiKeys": {"keys": [{"name": "team-a", "key": "k-1"}]}},
    "helm-tls": {"gateway": {"tls": {"secretName": "gateway-cert"},
                             "tracing": {"otlpTracesEndpoint": "http://otel-collector:4318/v1/traces"}, "drain": {"preStopSeconds": 10, "graceSeconds": 2,
                                                                             "timeoutSeconds": 900}}},
}


def manifest_sets() -> dict[str, object]:
    """Name -> a function returning that set's objects."""
    sets = {"k8s": k8s_objects}
    sets.update({name: (lambda v=values: helm_objects(v)) for name, values in HELM_VALUES.items()})
    return sets


def pods(objects: Iterable[dict]) -> Iterator[tuple[str, dict]]:
    """(workload name, pod spec) for every workload."""
    for o in objects:
        if o["kind"] in WORKLOADS:
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


def gateway_pod(objects: Iterable[dict]) -> dict:
    """The pod spec whose container is the gateway."""
    return next(pod for _, pod in pods(objects) if pod["containers"][0]["name"] == "gateway")


def gateway_config(objects: Iterable[dict]) -> dict:
    """The gateway.yaml the gateway pods mount, as a mapping."""
    volumes = {v["name"]: v for v in gateway_pod(objects)["volumes"]}
    name = volumes["config"]["configMap"]["name"]
    maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    if name in maps:
        return yaml.safe_load(maps[name]["data"]["gateway.yaml"])
    return yaml.safe_load((K8S / "gateway-config.yaml").read_text())  # kustomize generates it from this file


# What `kubectl create secret generic burstgate-keys --from-literal=KEY=...` would hold, where no Secret
# in the objects does.
STAND_INS = {"api-keys": '[{"name": "team-a", "key": "sk-team-a", "requests_per_minute": 60}]',
             "vllm-api-key": "sk-vllm-stand-in"}


def secret_environment(objects: Iterable[dict], container: dict) -> dict[str, str]:
    """The ``container``'s variables that come from Secrets: the value a Secret among ``objects`` holds
    (the chart's), else the stand-in for the one the operator creates."""
    objects = list(objects)
    secrets = {o["metadata"]["name"]: o.get("stringData", {}) for o in objects if o["kind"] == "Secret"}
    env = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            env[e["name"]] = secrets.get(ref["name"], STAND_INS).get(ref["key"], STAND_INS.get(ref["key"]))
    return env


def gateway_settings(objects: Iterable[dict]) -> Settings:
    """The gateway's settings as its pods load them: the mounted config, the environment from Secrets."""
    objects = list(objects)
    with mock.patch.dict(os.environ, secret_environment(objects, gateway_pod(objects)["containers"][0])):
        return Settings(**gateway_config(objects))


def containers(objects: Iterable[dict]) -> Iterator[tuple[str, dict]]:
    for name, pod in pods(objects):
        for c in pod.get("initContainers", []) + pod["containers"]:
            yield f"{name}/{c['name']}", c


def schema_errors(objects: Iterable[dict]) -> list[str]:
    """Each object checked against Kubernetes' own OpenAPI schema (strict: unknown fields are errors)."""
    errors = []
    for o in objects:
        try:
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(map(str, e.caught.absolute_path))
            errors.append(f"{o['kind']}/{o['metadata']['name']} at {path}: {e.caught.message}")
    return errors


def project_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
