"""Keys: matched in constant time, admin keys apart from client keys, never in a log line or an error body.
Request ids: accepted or made, returned, forwarded upstream and logged."""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import re
import subprocess
import sys

import httpx
import pytest
from pydantic import ValidationError

from gateway import auth
from gateway.app import create_app
from gateway.config import Settings
from gateway.service import Gateway
from loadtest.mock_server import create_mock_app
from tests.conftest import MODEL
from tests.servers import free_port, serve_app, wait_for_port

CLIENT, OTHER, ADMIN, UPSTREAM = "sk-client-1234", "sk-other-5678", "sk-admin-9012", "sk-upstream-3456"
BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_stored_key_is_compared_whichever_matches(start_gateway, monkeypatch):
    """No early exit: the time taken cannot tell which key matched, or whether one did."""
    compared, real = [], hmac.compare_digest

    def counting(a, b):
        compared.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = [{"name": "a", "key": CLIENT}, {"name": "b", "key": OTHER}, {"name": "c", "key": "sk-third"}]
    with start_gateway(api_keys=keys) as (url, _):
        for key, status in ((CLIENT, 200), ("sk-third", 200), ("sk-client-1235", 401)):
            compared.clear()
            assert httpx.get(f"{url}/v1/models", headers=_bearer(key)).status_code == status
            assert len(compared) == len(keys)


def test_admin_routes_take_admin_keys_and_only_them(start_gateway):
    with start_gateway(api_keys=[{"key": CLIENT}], admin_api_keys=[{"name": "ops", "key": ADMIN}]) as (url, _):
        assert httpx.get(f"{url}/admin/backends", headers=_bearer(ADMIN)).status_code == 200
        for headers in (_bearer(CLIENT), {}):
            r = httpx.get(f"{url}/admin/backends", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models", headers=_bearer(ADMIN)).status_code == 401  # not a client key
        assert httpx.get(f"{url}/v1/models", headers=_bearer(CLIENT)).status_code == 200
    with start_gateway(api_keys=[{"key": CLIENT}]) as (url, _):  # client keys alone never open /admin
        r = httpx.get(f"{url}/admin/backends", headers=_bearer(CLIENT))
        assert r.status_code == 401 and "no admin_api_keys" in r.json()["error"]["message"]
    with pytest.raises(ValidationError, match="must differ"):
        Settings(api_keys=[{"key": CLIENT}], admin_api_key=CLIENT)


def test_client_keys_can_be_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("CLIENT_KEY", CLIENT)
    (key,) = Settings(api_keys=[{"name": "team", "key": "os.environ/CLIENT_KEY"}]).api_keys
    assert key.key is None and auth.KeyRing([key]).match(CLIENT) is key
    monkeypatch.delenv("CLIENT_KEY")
    with pytest.raises(ValidationError, match="CLIENT_KEY named for API key 'team' is not set"):
        Settings(api_keys=[{"name": "team", "key": "os.environ/CLIENT_KEY"}])


def _recording(app, seen: list[dict[bytes, bytes]]):
    """``app`` noting the headers of every request it gets."""
    async def asgi(scope, receive, send):
        if scope["type"] == "http":
            seen.append(dict(scope["headers"]))
        await app(scope, receive, send)
    return asgi


@contextlib.contextmanager
def _gateway_before_upstream(monkeypatch, seen: list, **settings):
    """A gateway whose model is served by a real OpenAI-shaped upstream that wants ``UPSTREAM`` as its key."""
    monkeypatch.setenv("UPSTREAM_KEY", UPSTREAM)
    with serve_app(_recording(create_mock_app(), seen)) as up:
        deployment = {"kind": "openai", "url": f"{up}/v1", "upstream_model": "mock", "api_key_env": "UPSTREAM_KEY"}
        gateway = Gateway.from_settings(Settings(models=[{"name": MODEL, "deployments": [deployment]}], **settings))
        with serve_app(create_app(gateway)) as url:
            yield url


def test_keys_never_reach_a_log_line_or_an_error_body(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    bodies = []
    with _gateway_before_upstream(monkeypatch, [], api_keys=[{"key": CLIENT}], admin_api_key=ADMIN) as url:
        for key, path, body in ((CLIENT, "/v1/completions", BODY), ("sk-client-1235", "/v1/completions", BODY),
                                (CLIENT, "/admin/backends", None), (CLIENT, "/v1/completions", {"prompt": 1}),
                                (ADMIN, "/v1/completions", BODY), (f"{CLIENT} extra", "/v1/completions", BODY)):
            method = "POST" if body is not None else "GET"
            bodies.append(httpx.request(method, url + path, json=body, headers=_bearer(key), timeout=30).text)
    with pytest.raises(ValidationError) as config_error:
        Settings(api_keys=[{"key": CLIENT, "rpm": 1}], admin_api_key=CLIENT)
    statuses = [r.status for r in caplog.records if r.name == "burstgate.access"]
    assert statuses == [200, 401, 401, 400, 401, 401]  # every request was logged ...
    for text in (caplog.text, *map(str, caplog.records), *bodies, str(config_error.value)):
        for secret in (CLIENT, ADMIN, UPSTREAM, "sk-client-1235"):  # ... and no key, right or wrong, with it
            assert secret not in text


def test_request_ids_are_accepted_or_made_returned_forwarded_and_logged(monkeypatch, caplog):
    """vLLM's behaviour (vllm/entrypoints/serve/middleware/x_request_id.py): the client's X-Request-Id is
    returned, or a uuid4 hex made; its serving layer takes the same header as its own request id."""
    caplog.set_level(logging.INFO, logger="burstgate.access")
    seen: list[dict[bytes, bytes]] = []
    with _gateway_before_upstream(monkeypatch, seen) as url:
        r = httpx.post(f"{url}/v1/completions", json=BODY, headers={"X-Request-Id": "trace-42"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
        assert seen[-1][b"x-request-id"] == b"trace-42"
        with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True},
                          headers={"X-Request-Id": "trace-43"}) as r:
            r.read()
        assert r.headers["x-request-id"] == "trace-43" and seen[-1][b"x-request-id"] == b"trace-43"
        made = []
        for sent in ({}, {"X-Request-Id": "has space"}, {"X-Request-Id": "x" * 129}):
            r = httpx.post(f"{url}/v1/completions", json=BODY, headers=sent)
            made.append(r.headers["x-request-id"])
            assert re.fullmatch(r"[0-9a-f]{32}", made[-1]) and seen[-1][b"x-request-id"] == made[-1].encode()
        assert len(set(made)) == 3
        assert httpx.post(f"{url}/v1/completions", json={}).headers["x-request-id"]  # errors carry one too
    logged = {r.request_id: r for r in caplog.records if r.name == "burstgate.access"}
    assert {"trace-42", "trace-43", *made} <= set(logged)
    assert (logged["trace-42"].status, logged["trace-42"].path, logged["trace-42"].method) == (
        200, "/v1/completions", "POST")


def test_serve_can_write_json_log_lines_carrying_the_request_id_from_every_worker(tmp_path):
    with serve_app(create_mock_app()) as up:
        config = tmp_path / "gateway.yaml"
        config.write_text(f"models: [{{name: m, deployments: [{{kind: openai, url: '{up}/v1', upstream_model: mock}}]}}]")
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port",
                                 str(port), "--log-format", "json", "--workers", "2"], stderr=subprocess.PIPE, text=True)
        try:
            wait_for_port(port, proc=proc)  # the parent listens; the request waits for a worker to start
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "Hi"},
                           headers={"X-Request-Id": "trace-json"}, timeout=120)
            assert r.status_code == 200
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert len(lines) == len(err.splitlines())  # every line is one JSON object
    (access,) = [line for line in lines if line["logger"] == "burstgate.access"]
    assert access["request_id"] == "trace-json"
    assert (access["method"], access["path"], access["status"], access["level"]) == ("POST", "/v1/completions", 200,
                                                                                     "INFO")
