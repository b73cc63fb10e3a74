"""deploy/k8s starts as written: valid against Kubernetes' schemas, probes on real routes, Services the
gateway's URLs name, resources and security contexts on every pod, no scale fight with the HPA."""

from __future__ import annotations

import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.app import create_app
from gateway.config import load_settings
from gateway.service import Gateway
from tests.deploy.files import DEPLOY, K8S, containers, documents, k8s_objects, pods, project_version, schema_errors

GATEWAY_CONFIGS = [DEPLOY / "config" / "gateway.example.yaml", K8S / "gateway-config.yaml"]


def gateway_pod() -> dict:
    return next(pod for name, pod in pods(k8s_objects()) if name == "burstgate")


def test_every_yaml_file_parses():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 8
    for f in files:
        if "templates" not in f.parts:  # Helm templates are Go templates: tests/deploy/test_helm.py renders them
            assert documents(f), f


@pytest.mark.parametrize("path", GATEWAY_CONFIGS, ids=lambda p: p.name)
def test_gateway_configs_load_and_build_their_backends(path):
    gateway = Gateway.from_settings(load_settings(path))
    assert gateway.groups and all(g.deployments for g in gateway.groups.values())


def test_every_object_is_valid_against_the_kubernetes_schema():
    objects = k8s_objects()
    assert {"Namespace", "Deployment", "Service", "HorizontalPodAutoscaler"} <= {o["kind"] for o in objects}
    assert schema_errors(objects) == []


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_the_kustomize_build_is_valid_against_the_kubernetes_schema():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, check=True).stdout
    objects = [d for d in yaml.safe_load_all(out) if d]
    assert schema_errors(objects) == []
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    assert config_map["metadata"]["name"].startswith("burstgate-config-")  # hashed: pods roll on a config change
    images = {c["image"] for _, c in containers(objects)}
    assert f"ghcr.io/burstgate/burstgate:{project_version()}" in images


def test_the_image_tag_is_the_project_version():
    images = documents(K8S / "kustomization.yaml")[0]["images"]
    assert images == [{"name": "burstgate", "newName": "ghcr.io/burstgate/burstgate", "newTag": project_version()}]


def test_no_service_makes_kubernetes_inject_VLLM_PORT():
    """Kubernetes sets ``{SERVICE}_PORT=tcp://...`` in every pod of the namespace; vLLM reads VLLM_PORT as
    its internal port and refuses a URI (vLLM docs, "Environment Variables": do not name the service
    `vllm`). Service links are off everywhere, and no Service is named so that they would matter."""
    services = [o["metadata"]["name"] for o in k8s_objects() if o["kind"] == "Service"]
    injected = {re.sub(r"[-.]", "_", s).upper() + suffix for s in services for suffix in ("_PORT", "_SERVICE_HOST")}
    assert "VLLM_PORT" not in injected and "vllm-server" in services
    for name, pod in pods(k8s_objects()):
        assert pod.get("enableServiceLinks") is False, name


def test_every_url_in_the_gateway_config_names_a_service_and_its_port():
    services = {o["metadata"]["name"]: {p["port"] for p in o["spec"]["ports"]}
                for o in k8s_objects() if o["kind"] == "Service"}
    settings = load_settings(K8S / "gateway-config.yaml")
    urls = [d.url for m in settings.models for d in m.deployments if d.url] + [settings.limits.redis_url]
    assert len(urls) >= 3
    for url in urls:
        parts = urlsplit(url)
        assert parts.hostname in services, url
        assert parts.port in services[parts.hostname], url


def test_the_hpa_alone_sets_the_scale_of_what_it_scales():
    objects = k8s_objects()
    scaled = {o["spec"]["scaleTargetRef"]["name"] for o in objects if o["kind"] == "HorizontalPodAutoscaler"}
    assert scaled == {"burstgate"}
    for o in objects:
        if o["kind"] == "Deployment" and o["metadata"]["name"] in scaled:
            assert "replicas" not in o["spec"], "an apply would reset the HPA's scale"


def test_probes_are_routes_of_the_app_and_readiness_asks_whether_it_can_serve():
    gateway = Gateway.from_settings(load_settings(K8S / "gateway-config.yaml"))
    routes = {r.path for r in create_app(gateway, manage_lifecycle=False).routes}
    deployment = next(d for d in documents(K8S / "gateway.yaml") if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    probes = {p: container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes == {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    assert set(probes.values()) <= routes and pod["metadata"]["annotations"]["prometheus.io/path"] in routes
    port = container["ports"][0]["containerPort"]
    assert container["args"][container["args"].index("--port") + 1] == str(port)


def test_every_container_has_cpu_and_memory_requests_and_limits():
    for name, c in containers(k8s_objects()):
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})), f"{name}: {kind}"


def test_the_gateway_runs_as_many_threads_as_its_cpu_limit():
    container = gateway_pod()["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"] == {
        "containerName": container["name"], "resource": "limits.cpu", "divisor": "1"}


def test_every_pod_meets_the_restricted_profile_where_its_image_allows():
    """Pod Security Standards, "restricted": the gateway and Redis fully; vLLM's and TGI's images run as
    root, so they get everything but the user."""
    objects = k8s_objects()
    for name, pod in pods(objects):
        context = pod.get("securityContext", {})
        assert context.get("seccompProfile") == {"type": "RuntimeDefault"}, name
        assert pod.get("automountServiceAccountToken") is False, name
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False and sc.get("capabilities") == {"drop": ["ALL"]}, name
        if name in ("burstgate", "redis"):
            assert context["runAsNonRoot"] is True and isinstance(context["runAsUser"], int), name
            assert all(c["securityContext"]["readOnlyRootFilesystem"] for c in pod["containers"]), name


def test_client_keys_come_from_a_secret_and_reach_the_gateway(monkeypatch):
    env = {e["name"]: e for e in gateway_pod()["containers"][0]["env"]}
    ref = env["BURSTGATE_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "burstgate-keys"
    # What `kubectl create secret generic burstgate-keys --from-literal=api-keys=...` puts there:
    monkeypatch.setenv("BURSTGATE_API_KEYS", '[{"name": "team-a", "key": "sk-team-a", "requests_per_minute": 60}]')
    keys = load_settings(K8S / "gateway-config.yaml").api_keys
    assert [(k.name, k.requests_per_minute) for k in keys] == [("team-a", 60)] and keys[0].key is None


def test_kustomization_references_existing_files():
    k = documents(K8S / "kustomization.yaml")[0]
    for resource in k["resources"]:
        assert (K8S / resource).is_file(), resource
    for generator in k["configMapGenerator"]:
        for entry in generator["files"]:
            assert (K8S / entry.split("=")[-1]).is_file(), entry
