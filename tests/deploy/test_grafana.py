"""The Grafana dashboard queries only metrics that exist."""

from __future__ import annotations

import json
import re

from tests.deploy.files import DEPLOY


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
