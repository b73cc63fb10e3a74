"""The Kubernetes manifests start as written, for deploy/k8s and the Helm chart alike: valid against
Kubernetes' schemas, probes on real routes, Services that the gateway's URLs name, resources and security
contexts on every pod, keys from a Secret, no scale fight with the HPA."""

from __future__ import annotations

import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.app import create_app
from gateway.config import Settings, load_settings
from gateway.service import Gateway
from tests.deploy.files import (
    DEPLOY,
    K8S,
    containers,
    documents,
    gateway_config,
    gateway_pod,
    gateway_settings,
    helm_available,
    k8s_objects,
    manifest_sets,
    pods,
    project_version,
    schema_errors,
    secret_environment,
)

GATEWAY_CONFIGS = [DEPLOY / "config" / "gateway.example.yaml", K8S / "gateway-config.yaml"]


@pytest.fixture(params=list(manifest_sets()), scope="module")
def objects(request) -> list[dict]:
    if request.param.startswith("helm") and not helm_available():
        pytest.skip("helm-python-sdk (Helm's engine) is not installed on this platform")
    return manifest_sets()[request.param]()


def services(objects) -> dict[str, set[int]]:
    return {o["metadata"]["name"]: {p["port"] for p in o["spec"]["ports"]} for o in objects if o["kind"] == "Service"}


def test_every_object_is_valid_against_the_kubernetes_schema(objects):
    assert {"Deployment", "Service"} <= {o["kind"] for o in objects}
    assert schema_errors(objects) == []


def test_no_service_makes_kubernetes_inject_VLLM_PORT(objects):
    """Kubernetes sets ``{SERVICE}_PORT=tcp://...`` in every pod of the namespace; vLLM reads VLLM_PORT as
    its internal port and refuses a URI (vLLM docs, "Environment Variables": do not name the service
    `vllm`). Service links are off everywhere, and no Service is named so that they would matter."""
    injected = {re.sub(r"[-.]", "_", s).upper() + "_PORT" for s in services(objects)}
    assert "VLLM_PORT" not in injected
    for name, pod in pods(objects):
        assert pod.get("enableServiceLinks") is False, name


def test_every_url_in_the_gateway_config_names_a_service_and_its_port(objects):
    settings = gateway_settings(objects)
    urls = [d.url for m in settings.models for d in m.deployments if getattr(d, "url", None)]
    urls += [settings.limits.redis_url] if settings.limits.redis_url else []
    assert urls or all(d.kind == "native" for m in settings.routes() for d in m.deployments)
    for url in urls:
        parts = urlsplit(url)
        assert parts.hostname in services(objects), url
        assert parts.port in services(objects)[parts.hostname], url
    assert Gateway.from_settings(settings).groups


def test_discovered_replicas_come_from_a_headless_service_or_the_endpointslices_of_one(objects):
    """A DNS name discovered must be a headless Service's (a ClusterIP Service resolves to one address: one replica);
    a Kubernetes selector must pick a Service's slices, with the port it names."""
    specs = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Service"}
    for model in gateway_settings(objects).models:
        for d in (d for d in model.deployments if d.discover is not None):
            if d.discover.source == "dns":
                service = d.discover.name.split(".")[0]
                assert specs[service].get("clusterIP") == "None", service
                assert urlsplit(d.url).port in {p["port"] for p in specs[service]["ports"]}
            else:
                service = d.discover.selector.removeprefix("kubernetes.io/service-name=")
                assert d.discover.port_name in {p["name"] for p in specs[service]["ports"]}


def test_the_hpa_alone_sets_the_scale_of_what_it_scales(objects):
    scaled = {o["spec"]["scaleTargetRef"]["name"] for o in objects if o["kind"] == "HorizontalPodAutoscaler"}
    for o in objects:
        if o["kind"] == "Deployment":
            assert ("replicas" in o["spec"]) is (o["metadata"]["name"] not in scaled), o["metadata"]["name"]


def test_probes_are_routes_of_the_app_and_readiness_asks_whether_it_can_serve(objects):
    routes = set(create_app(Gateway.from_settings(Settings()), manage_lifecycle=False).openapi()["paths"])
    deployment = next(o for o in objects if o["kind"] == "Deployment"
                      and o["spec"]["template"]["spec"]["containers"][0]["name"] == "gateway")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    probes = {p: container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes == {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    assert set(probes.values()) <= routes and pod["metadata"]["annotations"]["prometheus.io/path"] in routes
    port = container["ports"][0]["containerPort"]
    assert container["args"][container["args"].index("--port") + 1] == str(port)


def test_the_grace_period_covers_the_pre_stop_pause_and_the_drain_so_no_stream_is_cut(objects):
    """Kubernetes kills the pod terminationGracePeriodSeconds after it began stopping it, preStop included: the
    gateway's preStop pause, its grace window and its drain deadline must all fit (gateway/drain.py)."""
    pod = gateway_pod(objects)
    container = pod["containers"][0]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and int(command[1]) > 0  # the endpoint goes before SIGTERM comes
    server = gateway_settings(objects).server
    assert pod["terminationGracePeriodSeconds"] >= int(command[1]) + server.drain_grace_s + server.drain_timeout_s


def test_every_container_has_cpu_and_memory_requests_and_limits(objects):
    for name, c in containers(objects):
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})), f"{name}: {kind}"


def test_the_gateway_runs_as_many_threads_as_its_cpu_limit(objects):
    container = gateway_pod(objects)["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"] == {
        "containerName": container["name"], "resource": "limits.cpu", "divisor": "1"}


def test_every_pod_meets_the_restricted_profile_where_its_image_allows(objects):
    """Pod Security Standards, "restricted": the gateway and Redis fully; vLLM's and TGI's images run as
    root, so they get everything but the user."""
    bound = {subject["name"] for o in objects if o["kind"] == "RoleBinding" for subject in o["subjects"]}
    for name, pod in pods(objects):
        context = pod.get("securityContext", {})
        assert context.get("seccompProfile") == {"type": "RuntimeDefault"}, name
        # no API token, except for a pod whose own service account is granted something (the gateway's discovery)
        assert pod.get("automountServiceAccountToken") is False or pod.get("serviceAccountName") in bound, name
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False and sc.get("capabilities") == {"drop": ["ALL"]}, name
            if c["name"] in ("gateway", "redis"):
                assert context["runAsNonRoot"] is True and isinstance(context["runAsUser"], int), name
                assert sc["readOnlyRootFilesystem"] is True, name


def test_what_the_api_lets_a_pod_do_is_read_endpointslices_and_nothing_else(objects):
    for role in (o for o in objects if o["kind"] in ("Role", "ClusterRole")):
        assert role["kind"] == "Role"  # this namespace only
        assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                  "verbs": ["get", "list", "watch"]}]


def test_client_keys_reach_the_gateway_only_from_a_secret(objects):
    env = {e["name"]: e for e in gateway_pod(objects)["containers"][0]["env"]}
    if "BURSTGATE_API_KEYS" not in env:
        assert not any("api-keys" in o.get("stringData", {}) for o in objects if o["kind"] == "Secret")
        return
    assert env["BURSTGATE_API_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "api-keys"
    # The value is what the chart's Secret holds, or what `kubectl create secret generic` would put in one.
    keys = gateway_settings(objects).api_keys
    assert keys and all(k.key is None and k.sha256 for k in keys)  # hashed at load, never kept


def _secret_refs(container: dict) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


def test_vllm_and_the_gateway_take_vllms_key_from_one_secret_and_no_config_holds_it(objects):
    gateway = gateway_pod(objects)["containers"][0]
    vllm = [c for _, pod in pods(objects) for c in pod["containers"] if c["name"] == "vllm"]
    if not vllm:
        assert "VLLM_API_KEY" not in _secret_refs(gateway)
        return
    ref = _secret_refs(gateway)["VLLM_API_KEY"]
    assert _secret_refs(vllm[0])["VLLM_API_KEY"] == ref and ref["key"] == "vllm-api-key"
    (written,) = [d for m in gateway_config(objects)["models"] for d in m["deployments"] if d["kind"] == "openai"]
    assert written["api_key"] == "os.environ/VLLM_API_KEY"  # a reference, not the key
    (loaded,) = [d for m in gateway_settings(objects).models for d in m.deployments if d.kind == "openai"]
    assert loaded.api_key == secret_environment(objects, vllm[0])["VLLM_API_KEY"]  # what vLLM itself is given
    assert all(loaded.api_key not in yaml.safe_dump(o) for o in objects if o["kind"] == "ConfigMap")


# ------------------------------------------------------------------------- deploy/k8s alone
def test_every_yaml_file_parses():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 8
    for f in files:
        if "templates" not in f.parts:  # Helm templates are Go templates: rendered by the fixture above
            assert documents(f), f


@pytest.mark.parametrize("path", GATEWAY_CONFIGS, ids=lambda p: p.name)
def test_gateway_configs_load_and_build_their_backends(path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")  # their vLLM deployments read it from the environment
    gateway = Gateway.from_settings(load_settings(path))
    assert gateway.groups and all(g.deployments for g in gateway.groups.values())


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


def test_the_vllm_service_is_not_named_vllm():
    assert "vllm-server" in services(k8s_objects()) and "vllm" not in services(k8s_objects())


def test_kustomization_references_existing_files():
    k = documents(K8S / "kustomization.yaml")[0]
    for resource in k["resources"]:
        assert (K8S / resource).is_file(), resource
    for generator in k["configMapGenerator"]:
        for entry in generator["files"]:
            assert (K8S / entry.split("=")[-1]).is_file(), entry
