"""Replicas discovered, not listed (gateway/discovery/): a deployment template whose replicas are what a DNS name
resolves to (a real DNS server the test controls: dnslib's, asked by dnspython) or the ready endpoints of
Kubernetes EndpointSlices (a local API server answering in the shapes of the Kubernetes docs). Replicas that
appear take requests, replicas that go finish what they run and take no more, a failed lookup changes nothing;
no restart.

Each replica is the mock OpenAI server on its own loopback address (127.0.0.x), all on one port, as pods of one
Deployment are.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSServer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.app import create_app
from gateway.config import ModelRoute, OpenAIDeployment, Resilience, Settings
from gateway.discovery import Address
from gateway.service import Gateway
from loadtest.mock_server import create_mock_app
from tests.servers import free_port, serve_app

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


class Zone(BaseResolver):
    """A DNS zone the test edits: name -> IPv4 addresses (no entry: NXDOMAIN)."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        if name not in self.records:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for address in self.records[name]:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=1))
        return reply


@contextlib.contextmanager
def dns_server(zone: Zone) -> Iterator[int]:
    port = free_port()
    server = DNSServer(zone, port=port, address="127.0.0.1")
    server.start_thread()
    try:
        yield port
    finally:
        server.stop()


@pytest.fixture(scope="module")
def replicas() -> Iterator[int]:
    """The mock server on each of HOSTS, at one port (a stream of 20 tokens lasts ~1 s)."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        for host in HOSTS:
            stack.enter_context(serve_app(create_mock_app("upstream", itl_s=0.05), host=host, port=port))
        yield port


def gateway_of(discover: dict, port: int) -> Gateway:
    template = OpenAIDeployment(kind="openai", name="vllm", url=f"http://vllm.test:{port}/v1", upstream_model="upstream",
                                discover={"interval_s": 0.1, **discover})
    return Gateway.from_settings(Settings(models=[ModelRoute(name="m", deployments=[template], routing="round_robin")],
                                          resilience=Resilience(health_interval_s=60)))


def members(url: str) -> set[str]:
    (model,) = httpx.get(f"{url}/admin/backends").json()["models"]
    return {d["name"] for d in model["deployments"]}


def names(port: int, *hosts: str) -> set[str]:
    return {f"vllm@{host}:{port}" for host in hosts}


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "discovery did not catch up"
        time.sleep(0.05)


def served_by(url: str, n: int) -> set[str]:
    """The replicas that answered ``n`` requests (the gateway's per-backend counter)."""
    before = _requests(url)
    for _ in range(n):
        assert httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1},
                          timeout=30).status_code == 200
    after = _requests(url)
    return {backend for backend, count in after.items() if count > before.get(backend, 0)}


def _requests(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("burstgate:requests_total{") and 'status="ok"' in line:
            backend = line.split('backend="')[1].split('"')[0]
            out[backend] = out.get(backend, 0) + float(line.rsplit(" ", 1)[1])
    return out


def stream(url: str, done: list) -> None:
    body = {"model": "m", "prompt": "Hi", "max_tokens": 20, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        done.append(response.read().decode())


def test_replicas_follow_what_a_dns_name_resolves_to_without_a_restart(replicas):
    zone = Zone()
    zone.records["vllm.test"] = HOSTS[:1]
    with dns_server(zone) as dns_port:
        gateway = gateway_of({"source": "dns", "name": "vllm.test", "nameservers": [f"127.0.0.1:{dns_port}"]}, replicas)
        with serve_app(create_app(gateway)) as url:
            assert members(url) == names(replicas, HOSTS[0])  # found before the gateway said it was ready
            zone.records["vllm.test"] = HOSTS[:2]  # scaled out
            wait_for(lambda: members(url) == names(replicas, *HOSTS[:2]))
            assert served_by(url, 6) == names(replicas, *HOSTS[:2])  # the new replica takes requests

            done: list = []
            streams = [threading.Thread(target=stream, args=(url, done)) for _ in range(2)]  # one on each replica
            for t in streams:
                t.start()
            time.sleep(0.3)
            zone.records["vllm.test"] = HOSTS[1:2]  # the first replica goes while it streams
            wait_for(lambda: members(url) == names(replicas, HOSTS[1]))
            for t in streams:
                t.join()
            assert len(done) == 2 and all(body.rstrip().endswith("data: [DONE]") and '"error"' not in body
                                          for body in done)  # what it ran finished
            assert served_by(url, 4) == names(replicas, HOSTS[1])  # and it takes no more
            wait_for(lambda: f'backend="vllm@{HOSTS[0]}:{replicas}"' not in httpx.get(f"{url}/metrics").text.split(
                "burstgate:backend_healthy")[1].split("# HELP")[0])  # its gauges went with it


def test_a_name_that_no_longer_exists_means_no_replicas_until_one_comes_back(replicas):
    zone = Zone()
    zone.records["vllm.test"] = HOSTS[:2]
    with dns_server(zone) as dns_port:
        gateway = gateway_of({"source": "dns", "name": "vllm.test", "nameservers": [f"127.0.0.1:{dns_port}"]},
                             replicas)
        with serve_app(create_app(gateway)) as url:
            assert members(url) == names(replicas, *HOSTS[:2])
            zone.records.clear()  # NXDOMAIN is an answer (scaled to zero), unlike a failed lookup
            wait_for(lambda: members(url) == set())
            assert httpx.get(f"{url}/ready").status_code == 503
            zone.records["vllm.test"] = HOSTS[2:]
            wait_for(lambda: members(url) == names(replicas, HOSTS[2]))
            assert httpx.get(f"{url}/ready").status_code == 200


def test_replicas_survive_their_dns_server_going_away(replicas):
    zone = Zone()
    zone.records["vllm.test"] = HOSTS[:2]
    with contextlib.ExitStack() as gateway_stack:
        with dns_server(zone) as dns_port:
            gateway = gateway_of({"source": "dns", "name": "vllm.test", "nameservers": [f"127.0.0.1:{dns_port}"],
                                  "timeout_s": 0.2}, replicas)
            url = gateway_stack.enter_context(serve_app(create_app(gateway)))
            assert members(url) == names(replicas, *HOSTS[:2])
        time.sleep(1.0)  # several lookups fail meanwhile
        assert members(url) == names(replicas, *HOSTS[:2])
        assert served_by(url, 4) == names(replicas, *HOSTS[:2])


# ------------------------------------------------------------------------------------------------ Kubernetes
def endpoint_slice(name: str, port: int, endpoints: list[dict], address_type: str = "IPv4") -> dict:
    """An EndpointSlice as the Kubernetes docs show one (concepts/services-networking/endpoint-slices)."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "serving", "labels": {"kubernetes.io/service-name": "vllm"}},
            "addressType": address_type, "ports": [{"name": "metrics", "protocol": "TCP", "port": 9090},
                                             {"name": "http", "protocol": "TCP", "port": port}],
            "endpoints": endpoints}


def endpoint(address: str, **conditions) -> dict:
    pod = f"vllm-{address.replace(':', '-').rsplit('.', 1)[-1]}"
    out = {"addresses": [address], "nodeName": "node-1", "zone": "us-west2-a",
           "targetRef": {"kind": "Pod", "namespace": "serving", "name": pod}}
    if conditions:
        out["conditions"] = conditions
    return out


class FakeAPIServer:
    """GET .../endpointslices with a label selector, as the Kubernetes API answers it (an EndpointSliceList; a 401
    Status without the service account's token)."""

    TOKEN = "service-account-token"

    def __init__(self) -> None:
        self.slices: list[dict] = []
        self.selectors: list[str] = []
        self.failing = False

    def app(self) -> Starlette:
        async def endpointslices(request: Request):
            if request.headers.get("authorization") != f"Bearer {self.TOKEN}":
                return JSONResponse({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                     "message": "Unauthorized", "reason": "Unauthorized", "code": 401}, 401)
            if self.failing:
                return JSONResponse({"kind": "Status", "status": "Failure", "code": 500}, 500)
            self.selectors.append(request.query_params.get("labelSelector", ""))
            assert request.path_params["namespace"] == "serving"
            return JSONResponse({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                 "metadata": {"resourceVersion": "1"}, "items": self.slices})

        return Starlette(routes=[Route("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                                       endpointslices)])


def test_replicas_are_the_ready_endpoints_of_the_endpointslices_a_selector_picks(replicas, tmp_path):
    api = FakeAPIServer()
    token = tmp_path / "token"
    token.write_text(api.TOKEN + "\n")
    # ready, no conditions (the API: read as ready), and terminating (ready false): the last is left out
    api.slices = [endpoint_slice("vllm-abc", replicas, [endpoint(HOSTS[0], ready=True, serving=True),
                                                        endpoint(HOSTS[2], ready=False, serving=True,
                                                                 terminating=True)]),
                  endpoint_slice("vllm-def", replicas, [endpoint(HOSTS[1])]),
                  # the same pods' other family (a dual-stack Service): not replicas of their own
                  endpoint_slice("vllm-v6", replicas, [endpoint("fd00::2"), endpoint("fd00::3")], "IPv6")]
    with serve_app(api.app()) as api_url:
        discover = {"source": "kubernetes", "selector": "kubernetes.io/service-name=vllm", "namespace": "serving",
                    "port_name": "http", "api_server": api_url, "token_file": str(token)}
        with serve_app(create_app(gateway_of(discover, port=1))) as url:  # the port comes from the slices
            assert api.selectors[0] == "kubernetes.io/service-name=vllm"
            assert members(url) == names(replicas, *HOSTS[:2])
            assert served_by(url, 4) == names(replicas, *HOSTS[:2])
            api.failing = True  # the API errs: nothing changes
            time.sleep(0.5)
            assert members(url) == names(replicas, *HOSTS[:2])
            api.failing = False
            api.slices = [endpoint_slice("vllm-abc", replicas, [endpoint(HOSTS[2], ready=True)])]  # rolled over
            wait_for(lambda: members(url) == names(replicas, HOSTS[2]))
            assert served_by(url, 3) == names(replicas, HOSTS[2])


def test_without_the_service_account_token_the_api_refuses_and_nothing_is_discovered(replicas):
    api = FakeAPIServer()
    with serve_app(api.app()) as api_url:
        discover = {"source": "kubernetes", "selector": "app=vllm", "namespace": "serving", "api_server": api_url}
        with serve_app(create_app(gateway_of(discover, replicas))) as url:
            assert members(url) == set() and httpx.get(f"{url}/ready").status_code == 503


def test_a_discovered_https_replica_checks_the_certificate_against_the_templates_host():
    template = OpenAIDeployment(kind="openai", name="vllm", url="https://vllm.serving.svc:8443/v1",
                                discover={"source": "dns", "name": "vllm-headless"})
    gateway = Gateway.from_settings(Settings(models=[ModelRoute(name="m", deployments=[template])]))
    replica = gateway.memberships[0].replica(Address("fd00::5", 8443))
    assert replica.url == "https://[fd00::5]:8443/v1" and replica.tls_server_name == "vllm.serving.svc"


def test_discover_is_refused_on_a_deployment_without_a_url():
    with pytest.raises(ValueError, match="discover: needs a remote deployment"):
        Settings(models=[{"name": "m", "deployments": [{"kind": "native", "discover": {
            "source": "dns", "name": "x"}}]}])
