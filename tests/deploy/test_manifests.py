"""deploy/ stays consistent with the code: configs load, files referenced exist, probes hit real routes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from gateway.app import create_app
from gateway.config import load_settings
from gateway.service import Gateway

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
GATEWAY_CONFIGS = [DEPLOY / "config" / "gateway.example.yaml", DEPLOY / "k8s" / "gateway-config.yaml"]


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_every_yaml_file_parses():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 8
    for f in files:
        assert documents(f), f


@pytest.mark.parametrize("path", GATEWAY_CONFIGS, ids=lambda p: p.name)
def test_gateway_configs_load_and_build_their_backends(path):
    gateway = Gateway.from_settings(load_settings(path))
    assert gateway.groups and all(g.deployments for g in gateway.groups.values())


def test_kubernetes_probes_and_scrape_paths_are_routes_of_the_app():
    gateway = Gateway.from_settings(load_settings(DEPLOY / "k8s" / "gateway-config.yaml"))
    routes = {r.path for r in create_app(gateway, manage_lifecycle=False).routes}
    deployment = next(d for d in documents(DEPLOY / "k8s" / "gateway.yaml") if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    probes = [container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
    assert set(probes) <= routes and pod["metadata"]["annotations"]["prometheus.io/path"] in routes
    port = container["ports"][0]["containerPort"]
    assert container["args"][container["args"].index("--port") + 1] == str(port)


def test_kustomization_references_existing_files():
    k = documents(DEPLOY / "k8s" / "kustomization.yaml")[0]
    for resource in k["resources"]:
        assert (DEPLOY / "k8s" / resource).is_file(), resource
    for generator in k["configMapGenerator"]:
        for entry in generator["files"]:
            assert (DEPLOY / "k8s" / entry.split("=")[-1]).is_file(), entry


def test_compose_and_dockerfile_reference_existing_files():
    compose = documents(DEPLOY / "compose.yaml")[0]
    gateway = compose["services"]["gateway-a"]
    assert (DEPLOY / gateway["build"]["context"] / gateway["build"]["dockerfile"]).is_file()
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), source
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    root = DEPLOY.parent
    for src in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", dockerfile, flags=re.M):
        for item in src.split():
            assert (root / item).exists(), item
    assert re.search(r"^EXPOSE 8000$", dockerfile, re.M) and '"--port", "8000"' in dockerfile


def test_grafana_dashboard_queries_only_metrics_the_gateway_exports():
    from backends.base import EngineStats
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.watch_engines(lambda: [("model", "backend", EngineStats())])
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    exported = {family.name + s for family in metrics.registry.collect() for s in suffixes.get(family.type, [""])}
    dashboard = json.loads((DEPLOY / "grafana" / "burstgate.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"burstgate:[a-z0-9_]+", target["expr"])}
    assert len(queried) >= 15 and queried <= exported, queried - exported
