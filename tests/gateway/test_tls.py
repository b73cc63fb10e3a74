"""TLS on both sides, with certificates the test makes (trustme: a throw-away CA): ``burstgate serve --ssl-*``
serves HTTPS and, when told, takes only clients with a certificate of its CA; an ``openai`` deployment reaches an
HTTPS upstream signed by a private CA that asks for the gateway's own certificate (mutual TLS)."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import trustme
from pydantic import ValidationError

from gateway.app import create_app
from gateway.config import DEFAULT_MODEL_NAME, ModelRoute, OpenAIDeployment, Resilience, Server, Settings
from gateway.http_server import uvicorn_options
from gateway.service import Gateway
from loadtest.mock_server import create_mock_app
from tests.servers import burstgate_serve, serve_app


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """PEM files: a CA, a server certificate for 127.0.0.1 and a client certificate, both signed by it, and a CA
    that signed neither."""
    folder = tmp_path_factory.mktemp("pki")
    ca, stranger = trustme.CA(), trustme.CA()
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("gateway.burstgate.test")
    named = ca.issue_cert("vllm.serving.svc")  # a Service's name only, as a discovered replica's certificate
    files = {"ca": ca.cert_pem, "stranger_ca": stranger.cert_pem, "server_key": server.private_key_pem,
             "server_cert": server.cert_chain_pems[0], "client_key": client.private_key_pem,
             "client_cert": client.cert_chain_pems[0], "named_key": named.private_key_pem,
             "named_cert": named.cert_chain_pems[0]}
    for name, blob in files.items():
        blob.write_to_path(str(folder / f"{name}.pem"))
    return {name: folder / f"{name}.pem" for name in files}


def client_context(pki, with_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki["ca"])
    if with_certificate:
        context.load_cert_chain(pki["client_cert"], pki["client_key"])
    return context


def test_serve_answers_over_https_and_only_clients_with_a_certificate_of_its_ca_when_told(pki):
    options = ("--simulate", "cpu-epyc-2c", "--ssl-keyfile", str(pki["server_key"]), "--ssl-certfile",
               str(pki["server_cert"]), "--ssl-ca-certs", str(pki["ca"]), "--ssl-cert-reqs", "2")
    trusted = client_context(pki, with_certificate=True)
    with burstgate_serve(*options, verify=trusted) as served:
        assert served.url.startswith("https://")
        sdk = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", http_client=httpx.Client(verify=trusted))
        answer = sdk.completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=3)
        assert answer.usage.completion_tokens == 3
        with pytest.raises(httpx.TransportError):  # no client certificate: the handshake fails
            httpx.get(f"{served.url}/health", verify=client_context(pki, with_certificate=False))
        with pytest.raises(httpx.TransportError):  # plain HTTP is not spoken there
            httpx.get(served.url.replace("https://", "http://") + "/health")
        # The SDK's connection stays open, idle in its pool, and the client does not read it: a polite TLS close
        # would wait 30 s for its close_notify. Stopped, the server drops it and exits at once.
        served.proc.terminate()
        served.proc.wait(timeout=15)


def test_a_stream_answering_when_the_server_stops_ends_whole_and_the_server_exits_without_its_client(pki):
    options = ("--simulate", "cpu-epyc-2c", "--ssl-keyfile", str(pki["server_key"]), "--ssl-certfile",
               str(pki["server_cert"]))
    trusted = client_context(pki, with_certificate=False)
    with burstgate_serve(*options, verify=trusted) as served, httpx.Client(verify=trusted, timeout=60) as client:
        body = {"model": DEFAULT_MODEL_NAME, "prompt": "Hi", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with client.stream("POST", f"{served.url}/v1/completions", json=body) as stream:
            lines = []
            for line in stream.iter_lines():
                if not lines:
                    served.proc.terminate()  # the drain lets the answer under way finish
                lines.append(line)
        assert "data: [DONE]" in lines  # the whole answer
        # the client keeps the connection in its pool, unread: the server closes it after the answer and does
        # not wait out asyncio's 30 s for the client's close_notify
        served.proc.wait(timeout=20)


def test_an_idle_keep_alive_connection_timed_out_is_gone_within_the_grace_though_its_client_never_reads(
        pki, monkeypatch):
    """A TLS close waits for the client's close_notify, which a client idle in its pool sends only when it next
    reads (asyncio waits 30 s): the keep-alive timeout's close is bounded as every TLS close is."""
    monkeypatch.setattr("gateway.http_server.TLS_CLOSE_GRACE_S", 1.0)
    server = Server(keep_alive_timeout_s=0.5)
    with serve_app(create_mock_app(), ssl_keyfile=str(pki["server_key"]), ssl_certfile=str(pki["server_cert"]),
                   **uvicorn_options(server)) as url:
        port = int(url.rsplit(":", 1)[1])
        context = client_context(pki, with_certificate=False)
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            assert tls.recv(65536).startswith(b"HTTP/1.1 200")  # answered, kept alive; then never read again
            client_port = tls.getsockname()[1]

            def server_side_open() -> bool:  # the server runs in this process: its end of the connection
                return any(c.laddr and c.raddr and c.laddr.port == port and c.raddr.port == client_port
                           for c in psutil.Process().net_connections(kind="tcp"))

            assert server_side_open()
            deadline = time.monotonic() + 10  # timeout 0.5 s + grace 1 s, far below asyncio's 30 s
            while server_side_open() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not server_side_open()


@pytest.fixture(scope="module")
def upstream(pki):
    """The mock OpenAI server over HTTPS, requiring a client certificate of the CA."""
    with serve_app(create_mock_app(), ssl_keyfile=str(pki["server_key"]), ssl_certfile=str(pki["server_cert"]),
                   ssl_ca_certs=str(pki["ca"]), ssl_cert_reqs=ssl.CERT_REQUIRED) as url:
        yield url.replace("http://", "https://") + "/v1"


def gateway_to(upstream: str, **tls) -> Gateway:
    deployment = OpenAIDeployment(kind="openai", url=upstream, upstream_model="mock", **tls)
    return Gateway.from_settings(Settings(models=[ModelRoute(name="m", deployments=[deployment])],
                                          resilience=Resilience(retries=0, health_interval_s=60)))


def complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 3}, timeout=30)


def test_an_openai_deployment_reaches_an_https_upstream_with_its_ca_bundle_and_client_certificate(pki, upstream):
    gateway = gateway_to(upstream, ca_bundle=pki["ca"], client_cert=pki["client_cert"], client_key=pki["client_key"])
    with serve_app(create_app(gateway)) as url:
        assert httpx.get(f"{url}/ready").status_code == 200  # the health check went through TLS too
        reply = complete(url)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("case", ["no client certificate", "the system's CAs", "another CA"])
def test_an_upstream_whose_tls_check_fails_is_unavailable_not_a_server_error(pki, upstream, case):
    tls = {"no client certificate": {"ca_bundle": pki["ca"]},
           "the system's CAs": {"client_cert": pki["client_cert"], "client_key": pki["client_key"]},
           "another CA": {"ca_bundle": pki["stranger_ca"], "client_cert": pki["client_cert"],
                          "client_key": pki["client_key"]}}[case]
    with serve_app(create_app(gateway_to(upstream, **tls))) as url:
        reply = complete(url)
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable", reply.text


def test_an_upstream_reached_at_an_address_is_checked_against_the_name_its_certificate_carries(pki):
    with serve_app(create_mock_app(), ssl_keyfile=str(pki["named_key"]), ssl_certfile=str(pki["named_cert"])) as url:
        upstream = url.replace("http://", "https://") + "/v1"
        for server_name, status in ((None, 503), ("vllm.serving.svc", 200)):  # the address is not in the certificate
            gateway = gateway_to(upstream, ca_bundle=pki["ca"], tls_server_name=server_name)
            with serve_app(create_app(gateway)) as gateway_url:
                assert complete(gateway_url).status_code == status


@pytest.mark.parametrize("tls, words", [
    ({"client_key": "client_key"}, "client_key needs client_cert"),
    ({"ca_bundle": "client_key"}, "TLS files do not load"),  # a key is no CA bundle
    ({"client_cert": "ca", "client_key": "server_key"}, "TLS files do not load"),  # a certificate without its key
])
def test_tls_files_that_do_not_load_are_refused_when_the_config_loads(pki, tls, words):
    with pytest.raises(ValidationError, match=words):
        OpenAIDeployment(kind="openai", url="https://upstream/v1", **{k: pki[v] for k, v in tls.items()})


def test_a_tls_file_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(ValidationError, match="ca_bundle"):
        OpenAIDeployment(kind="openai", url="https://upstream/v1", ca_bundle=tmp_path / "missing.pem")


@pytest.mark.parametrize("files, words", [
    (("server_key", "ca"), "--ssl-certfile / --ssl-keyfile"),  # a CA's certificate with the server's key
    (("server_key", "server_cert", "server_key"), "--ssl-ca-certs"),  # a key where CA certificates belong
])
def test_serve_names_tls_files_that_do_not_load_before_starting(pki, files, words):
    from typer.testing import CliRunner

    from gateway.cli import app

    flags = ["--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs"]
    args = [x for flag, name in zip(flags, files) for x in (flag, str(pki[name]))]
    result = CliRunner().invoke(app, ["serve", *args, "--ssl-cert-reqs", "2" if len(files) == 3 else "0"])
    assert result.exit_code == 2 and words in result.output, result.output
