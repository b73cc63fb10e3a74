"""Readiness means "this gateway can serve": one model's outage never fails ``/ready`` (Kubernetes would
pull every gateway pod out of its Service); per-model health is ``/ready?model=`` and ``burstgate:model_ready``."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from gateway.app import create_app
from gateway.config import ModelRoute, OpenAIDeployment, Resilience, Settings
from gateway.service import Gateway
from loadtest.mock_server import create_mock_app
from tests.gateway.test_failover import metric
from tests.servers import free_port, serve_app


def remote(url: str) -> OpenAIDeployment:
    return OpenAIDeployment(kind="openai", url=url, upstream_model="mock")


@contextlib.contextmanager
def gateway_with(models: list[ModelRoute]):
    settings = Settings(models=models, resilience=Resilience(health_interval_s=60, health_timeout_s=1.0))
    with serve_app(create_app(Gateway.from_settings(settings))) as url:  # start() checks health once
        yield url


@pytest.fixture(scope="module")
def up_url():
    with serve_app(create_mock_app()) as url:
        yield f"{url}/v1"


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there


def test_one_model_down_leaves_the_gateway_ready_and_is_reported_per_model(up_url):
    models = [ModelRoute(name="up", deployments=[remote(up_url)]),
              ModelRoute(name="down", deployments=[remote(dead_url())]),
              ModelRoute(name="down-with-fallback", deployments=[remote(dead_url())], fallbacks=["up"])]
    with gateway_with(models) as url:
        r = httpx.get(f"{url}/ready")
        assert r.status_code == 200
        assert r.json() == {"ready": True, "models": {"up": True, "down": False, "down-with-fallback": True}, "draining": False}

        r = httpx.get(f"{url}/ready", params={"model": "down"})
        assert (r.status_code, r.json()) == (503, {"ready": False, "models": {"down": False}, "draining": False})
        for name in ("up", "down-with-fallback"):  # a healthy fallback serves the model's requests
            r = httpx.get(f"{url}/ready", params={"model": name})
            assert (r.status_code, r.json()) == (200, {"ready": True, "models": {name: True}, "draining": False})

        assert metric(url, "burstgate:model_ready", model="up") == 1
        assert metric(url, "burstgate:model_ready", model="down") == 0
        assert metric(url, "burstgate:model_ready", model="down-with-fallback") == 1


def test_ready_for_an_unknown_model_is_a_404_in_openai_shape(up_url):
    with gateway_with([ModelRoute(name="up", deployments=[remote(up_url)])]) as url:
        r = httpx.get(f"{url}/ready", params={"model": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


def test_with_no_model_servable_the_gateway_is_not_ready():
    with gateway_with([ModelRoute(name="a", deployments=[remote(dead_url())]),
                       ModelRoute(name="b", deployments=[remote(dead_url())])]) as url:
        r = httpx.get(f"{url}/ready")
        assert (r.status_code, r.json()) == (503, {"ready": False, "models": {"a": False, "b": False}, "draining": False})
        assert httpx.get(f"{url}/health").status_code == 200  # alive: liveness must not restart it
