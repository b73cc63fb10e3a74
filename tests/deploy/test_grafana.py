"""The Grafana dashboard: every query is PromQL over metrics that exist, aggregated across gateway
replicas and filtered by the dashboard's variables (model, backend, instance); the prefix-cache hit rate
is a rate over the interval; vLLM's and TGI's own metrics have their panels."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import promql_parser
from prometheus_client.metrics import MetricWrapperBase

from backends.base import EngineStats
from gateway.metrics import GatewayMetrics
from tests.deploy.files import DEPLOY

SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
# vLLM's own names (vllm/v1/metrics/loggers.py; prometheus_client adds _total to counters).
VLLM = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"} | {
    f"vllm:{h}_bucket" for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                                 "inter_token_latency_seconds", "request_queue_time_seconds",
                                 "request_prefill_time_seconds", "request_decode_time_seconds")}
# TGI's (docs/source/reference/metrics.md; its exporter adds no suffix to counters).
TGI = {"tgi_request_count", "tgi_request_success", "tgi_request_failure", "tgi_queue_size", "tgi_batch_current_size",
       "tgi_batch_current_max_tokens"} | {
    f"tgi_{h}_bucket" for h in ("request_duration", "request_queue_duration", "request_mean_time_per_token_duration",
                                "request_generated_tokens", "request_input_length", "batch_forward_duration")}
VARIABLES = {"model": "$model", "backend": "$backend", "instance": "$instance"}


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "burstgate.json").read_text())


def panels() -> Iterator[dict]:
    for panel in dashboard()["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def expressions() -> list[str]:
    return [t["expr"] for p in panels() for t in p.get("targets", [])]


def parse(expr: str):
    """PromQL, with Grafana's variables replaced by what it would put there."""
    return promql_parser.parse(expr.replace("$__rate_interval", "1m").replace('=~"$', '=~"x').replace("$", ""))


def selectors(node) -> Iterator:
    """Every vector selector under ``node``."""
    if isinstance(node, promql_parser.VectorSelector):
        yield node
    for attr in ("lhs", "rhs", "expr", "vector_selector"):
        child = getattr(node, attr, None)
        if child is not None:
            yield from selectors(child)
    for arg in getattr(node, "args", None) or []:
        yield from selectors(arg)


def exported() -> dict[str, set[str]]:
    """Every sample name the gateway exports, with the labels its family carries."""
    metrics = GatewayMetrics()
    metrics.watch_engines(lambda: [("model", "backend", EngineStats())])
    metrics.watch_models(lambda: [("model", True)])
    declared = {w._name: set(w._labelnames) for w in vars(metrics).values() if isinstance(w, MetricWrapperBase)}
    out = {}
    for family in metrics.registry.collect():
        labels = {label for s in family.samples for label in s.labels} - {"le"} | declared.get(family.name, set())
        for suffix in SUFFIXES.get(family.type, [""]):
            out[family.name + suffix] = labels
    return out


def aggregated(node) -> bool:
    """Whole-fleet figures only: the root aggregates (or divides or quantiles aggregates)."""
    if isinstance(node, promql_parser.AggregateExpr):
        return True
    if isinstance(node, promql_parser.BinaryExpr):
        return aggregated(node.lhs) and aggregated(node.rhs)
    if isinstance(node, promql_parser.Call) and node.func.name == "histogram_quantile":
        inner = node.args[1]
        return isinstance(inner, promql_parser.AggregateExpr) and "le" in inner.modifier.labels
    return isinstance(node, promql_parser.ParenExpr) and aggregated(node.expr)


def test_every_query_parses_and_names_metrics_that_exist():
    gateway = exported()
    names = {s.name for e in expressions() for s in selectors(parse(e))}
    ours = {n for n in names if n.startswith("burstgate:")}
    assert len(ours) >= 18 and ours <= set(gateway), ours - set(gateway)
    assert names - ours <= VLLM | TGI, names - ours - VLLM - TGI
    assert {n for n in names if n.startswith("vllm:")} and {n for n in names if n.startswith("tgi_")}


def test_every_query_aggregates_across_replicas():
    for expr in expressions():
        assert aggregated(parse(expr)), expr


def test_every_gateway_query_follows_the_dashboard_variables():
    gateway = exported()
    for expr in expressions():
        for s in selectors(parse(expr)):
            if s.name.startswith("burstgate:"):
                matchers = {m.name: m.value for m in s.matchers.matchers}
                wanted = {label for label in VARIABLES if label in gateway[s.name] or label == "instance"}
                assert {k: matchers.get(k) for k in wanted} == {k: "x" + VARIABLES[k][1:] for k in wanted}, expr


def test_the_prefix_cache_hit_rate_is_a_rate_over_the_interval_not_a_lifetime_ratio():
    assert not [e for e in expressions() if "burstgate:prefix_cache_hit_rate" in e]
    rates = [e for e in expressions() if "prefix_cache_hits_total" in e and e.startswith("sum by (model)")]
    assert len(rates) == 1
    tree = parse(rates[0])
    assert str(tree.op) == "/"
    assert [s.name for s in selectors(tree.lhs)] == ["burstgate:prefix_cache_hits_total"]
    assert [s.name for s in selectors(tree.rhs)] == ["burstgate:prefix_cache_queries_total"]
    assert all(re.search(r"rate\(burstgate:prefix_cache_\w+_total\{[^}]*\}\[\$__rate_interval\]\)", side)
               for side in rates[0].split(" / "))


def test_the_variables_list_what_the_gateways_export():
    gateway = exported()
    variables = {v["name"]: v["query"]["query"] for v in dashboard()["templating"]["list"]}
    assert set(variables) == set(VARIABLES)
    for name, query in variables.items():
        metric, label = re.fullmatch(r"label_values\(([\w:]+), (\w+)\)", query).groups()
        assert metric in gateway and label == name and (label in gateway[metric] or label == "instance")


def test_panel_ids_are_unique():
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
