"""Reading deploy/: YAML documents, the Kubernetes objects in them, their pods and containers."""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.30"  # the oldest minor the manifests must be valid for
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def k8s_objects() -> list[dict]:
    """Every object that `kubectl apply -k deploy/k8s` sends, read from the kustomization's resources."""
    kustomization = documents(K8S / "kustomization.yaml")[0]
    return [d for resource in kustomization["resources"] for d in documents(K8S / resource)]


def pods(objects: Iterable[dict]) -> Iterator[tuple[str, dict]]:
    """(workload name, pod spec) for every workload."""
    for o in objects:
        if o["kind"] in WORKLOADS:
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


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
