"""The Helm chart deploy/helm/burstgate: lint-clean, its toggles (vLLM, TGI, Redis, autoscaling, keys)
render what they say, its values are documented, and it runs the published image. Rendering uses Helm's
own engine through helm-python-sdk in the default suite; a `helm` binary, where installed, is run too.
The Kubernetes checks on the rendered objects are in test_manifests.py (manifest sets "helm-*")."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from gateway.service import Gateway
from tests.deploy.files import (
    CHART,
    gateway_pod,
    gateway_settings,
    helm_available,
    helm_objects,
    project_version,
)

pytestmark = pytest.mark.skipif(not helm_available(), reason="helm-python-sdk (Helm's engine) is not installed here")


def kinds(objects: list[dict]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for o in objects:
        out.setdefault(o["kind"], set()).add(o["metadata"]["name"])
    return out


def test_the_chart_lints_clean():
    import helm_python

    report = helm_python.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # no warning or error


def test_by_default_the_gateway_redis_and_the_hpa_and_no_gpu_server():
    objects = helm_objects()
    assert kinds(objects) == {"ConfigMap": {"demo-burstgate-config"},
                              "Deployment": {"demo-burstgate", "demo-burstgate-redis"},
                              "Service": {"demo-burstgate", "demo-burstgate-redis"},
                              "HorizontalPodAutoscaler": {"demo-burstgate"}}
    config = gateway_settings(objects)
    assert [d.kind for d in config.models[0].deployments] == ["native"]
    assert config.limits.redis_url == "redis://demo-burstgate-redis:6379/0"


def test_vllm_and_tgi_are_toggles_and_join_the_model():
    objects = helm_objects({"vllm": {"enabled": True, "extraArgs": ["--max-model-len", "4096"]},
                            "tgi": {"enabled": True}})
    assert {"demo-burstgate-vllm", "demo-burstgate-tgi"} <= kinds(objects)["Deployment"]
    config = gateway_settings(objects)
    assert [(d.kind, getattr(d, "url", None)) for d in config.models[0].deployments] == [
        ("openai", "http://demo-burstgate-vllm:8000/v1"), ("tgi", "http://demo-burstgate-tgi:80"), ("native", None)]
    vllm = next(o for o in objects if o["metadata"]["name"] == "demo-burstgate-vllm")
    args = vllm["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.9" and args[-2:] == ["--max-model-len", "4096"]


@pytest.mark.parametrize("discovery", ["kubernetes", "dns", "service"])
def test_the_gateway_finds_each_vllm_replica_as_the_discovery_value_says(discovery):
    objects = helm_objects({"vllm": {"enabled": True, "replicas": 4, "discovery": discovery}})
    (vllm,) = [d for d in gateway_settings(objects).models[0].deployments if d.name == "vllm"]
    services = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Service"}
    pod = gateway_pod(objects)
    if discovery == "kubernetes":
        assert vllm.discover.selector == "kubernetes.io/service-name=demo-burstgate-vllm"
        assert vllm.discover.port_name == "http" and "http" in {p["name"] for p in services["demo-burstgate-vllm"]["ports"]}
        assert pod["serviceAccountName"] == "demo-burstgate" and pod["automountServiceAccountToken"] is True
    elif discovery == "dns":
        assert vllm.discover.name == "demo-burstgate-vllm-headless"
        assert services["demo-burstgate-vllm-headless"]["clusterIP"] == "None"
    else:
        assert vllm.discover is None and vllm.url == "http://demo-burstgate-vllm:8000/v1"
    if discovery != "kubernetes":
        assert pod["automountServiceAccountToken"] is False and not any(o["kind"] == "Role" for o in objects)


def test_without_autoscaling_the_deployment_carries_the_replicas():
    objects = helm_objects({"gateway": {"autoscaling": {"enabled": False}, "replicas": 3}})
    assert "HorizontalPodAutoscaler" not in kinds(objects)
    gateway = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-burstgate")
    assert gateway["spec"]["replicas"] == 3


def test_keys_come_from_an_existing_secret_or_one_the_chart_makes():
    existing = helm_objects({"apiKeys": {"existingSecret": "my-keys"}})
    env = {e["name"]: e for e in gateway_pod(existing)["containers"][0]["env"]}
    assert env["BURSTGATE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "my-keys", "key": "api-keys"}
    assert "Secret" not in kinds(existing)
    made = helm_objects({"apiKeys": {"keys": [{"name": "team-a", "key": "k-1", "requests_per_minute": 60}]}})
    assert kinds(made)["Secret"] == {"demo-burstgate-keys"}
    assert "BURSTGATE_API_KEYS" not in {e["name"] for e in gateway_pod(helm_objects())["containers"][0]["env"]}


def test_vllms_key_is_given_or_made_by_the_chart_unless_an_existing_secret_holds_it():
    def vllm_key(values: dict) -> str | None:
        objects = helm_objects({**values, "vllm": {"enabled": True, **values.get("vllm", {})}})
        secrets = [o for o in objects if o["kind"] == "Secret"]
        assert [o["metadata"]["name"] for o in secrets] == ([] if "apiKeys" in values else ["demo-burstgate-keys"])
        (openai,) = [d for m in gateway_settings(objects).models for d in m.deployments if d.kind == "openai"]
        return openai.api_key

    assert vllm_key({"vllm": {"apiKey": "sk-given"}}) == "sk-given"
    made = vllm_key({})
    assert len(made) == 48 and made.isalnum()
    assert vllm_key({"apiKeys": {"existingSecret": "ops-keys"}}) == "sk-vllm-stand-in"  # what ops-keys holds


def test_everything_off_serves_the_embedded_model_and_config_overrides_merge():
    objects = helm_objects({"native": {"enabled": False}, "redis": {"enabled": False},
                            "gateway": {"config": {"resilience": {"retries": 5}, "limits": {"max_body_bytes": 100000}}}})
    settings = gateway_settings(objects)
    assert settings.models == [] and settings.resilience.retries == 5 and settings.limits.max_body_bytes == 100000
    assert Gateway.from_settings(settings).groups  # the embedded default


def test_a_tls_secret_serves_https_and_the_probes_and_scrapes_follow():
    pod = gateway_pod(helm_objects({"gateway": {"tls": {"secretName": "gateway-cert"}}}))
    container = pod["containers"][0]
    args = container["args"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
    assert args[args.index("--ssl-certfile") + 1] == f"{mount['mountPath']}/tls.crt"
    assert args[args.index("--ssl-keyfile") + 1] == f"{mount['mountPath']}/tls.key"
    assert next(v for v in pod["volumes"] if v["name"] == "tls")["secret"] == {"secretName": "gateway-cert"}
    assert {container[p]["httpGet"]["scheme"] for p in ("startupProbe", "livenessProbe", "readinessProbe")} == {"HTTPS"}
    plain = gateway_pod(helm_objects())["containers"][0]
    assert "--ssl-certfile" not in plain["args"] and "scheme" not in plain["readinessProbe"]["httpGet"]


def test_tracing_is_off_unless_a_collector_is_named():
    assert gateway_settings(helm_objects()).tracing.otlp_traces_endpoint is None
    tracing = gateway_settings(helm_objects({"gateway": {"tracing": {
        "otlpTracesEndpoint": "http://otel-collector:4318/v1/traces", "sampleRatio": 0.25}}})).tracing
    assert (tracing.otlp_traces_endpoint, tracing.sample_ratio) == ("http://otel-collector:4318/v1/traces", 0.25)
    assert tracing.service_name == "demo-burstgate"


def test_the_drain_values_reach_the_gateway_and_its_grace_period():
    objects = helm_objects({"gateway": {"drain": {"preStopSeconds": 7, "graceSeconds": 3, "timeoutSeconds": 600}}})
    server = gateway_settings(objects).server
    assert (server.drain_grace_s, server.drain_timeout_s) == (3, 600)
    pod = gateway_pod(objects)
    assert pod["terminationGracePeriodSeconds"] == 7 + 3 + 600 + 10
    assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]


def test_the_config_checksum_rolls_the_pods_when_the_config_changes():
    def checksum(values):
        pod = next(o for o in helm_objects(values) if o["kind"] == "Deployment" and o["metadata"]["name"] ==
                   "demo-burstgate")["spec"]["template"]
        return pod["metadata"]["annotations"]["checksum/config"]

    assert checksum({}) != checksum({"gateway": {"config": {"resilience": {"retries": 3}}}})


def test_it_runs_the_published_image_of_this_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == project_version()
    assert gateway_pod(helm_objects())["containers"][0]["image"] == f"ghcr.io/burstgate/burstgate:{project_version()}"


def test_every_value_is_documented():
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-zA-Z]\w*:", line):  # a top-level key: a comment says what it is
            assert lines[i - 1].startswith("#"), line


@pytest.mark.skipif(shutil.which("helm") is None, reason="no helm binary on PATH")
def test_the_helm_binary_lints_and_renders_what_the_sdk_renders(tmp_path):
    subprocess.run(["helm", "lint", "--strict", str(CHART)], check=True, capture_output=True)
    out = subprocess.run(["helm", "template", "demo", str(CHART), "--namespace", "burstgate"], check=True,
                         capture_output=True, text=True).stdout
    rendered = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out) if d)
    assert rendered == sorted((o["kind"], o["metadata"]["name"]) for o in helm_objects())


def test_a_misspelt_value_is_refused_not_ignored():
    import helm_python

    with pytest.raises(helm_python.HelmValuesError, match="gpuMemoryUtilisation"):
        helm_objects({"vllm": {"gpuMemoryUtilisation": 0.5}})
    with pytest.raises(helm_python.HelmValuesError, match="gpuMemoryUtilization"):
        helm_objects({"vllm": {"gpuMemoryUtilization": 1.5}})
