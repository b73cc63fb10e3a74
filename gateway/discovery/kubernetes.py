"""Replicas from the Kubernetes API: the ready endpoints of the EndpointSlices (``discovery.k8s.io/v1``) that a
label selector picks, e.g. ``kubernetes.io/service-name=vllm`` for a Service's, in one namespace. Read with the
pod's service account (its token is read again at each lookup: Kubernetes rotates it), which needs ``list`` on
``endpointslices`` (the Helm chart's Role grants it). Only slices of ``address_type`` count (a dual-stack
Service has one of each family, for the same pods). An endpoint whose ``ready`` condition is false (a pod
starting, or terminating) is left out; an absent condition counts as ready, as the API documents."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Literal

import httpx
from pydantic import Field

from gateway.discovery.source import Address, DiscoveryError, DiscoverySource

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubernetesDiscovery(DiscoverySource):
    """``discover: {source: kubernetes, selector: "kubernetes.io/service-name=vllm"}``"""

    source: Literal["kubernetes"]
    selector: str = Field(min_length=1)  # a label selector on EndpointSlices
    namespace: str | None = None  # default: the pod's own
    port_name: str | None = None  # the EndpointSlice port of this name; default: `port`, else the slice's first
    # default: in the cluster (KUBERNETES_SERVICE_HOST / _PORT, the service account's token and CA)
    api_server: str | None = None
    token_file: Path | None = None  # the bearer token; default: the service account's
    ca_file: Path | None = None  # the API server's CA; default: the service account's
    timeout_s: float = Field(5.0, gt=0)  # for one request to the API server

    async def addresses(self, default_port: int) -> set[Address]:
        url = f"{self._api_server()}/apis/discovery.k8s.io/v1/namespaces/{self._namespace()}/endpointslices"
        try:
            async with httpx.AsyncClient(verify=self._verify(), timeout=self.timeout_s) as http:
                reply = await http.get(url, params={"labelSelector": self.selector}, headers=self._auth())
        except httpx.HTTPError as exc:
            raise DiscoveryError(f"the Kubernetes API at {url} is unreachable: {exc!r}") from exc
        if reply.status_code != 200:
            raise DiscoveryError(f"the Kubernetes API answered {reply.status_code} for {url}: {reply.text[:300]}")
        try:
            slices = reply.json()["items"]
        except (ValueError, KeyError) as exc:
            raise DiscoveryError(f"the Kubernetes API's answer is no EndpointSliceList: {reply.text[:300]}") from exc
        return {address for item in slices or () if item.get("addressType") == self.address_type
                for address in self._ready(item, default_port)}

    def _ready(self, item: dict, default_port: int) -> list[Address]:
        port = self._port(item.get("ports") or [], default_port)
        if port is None:
            return []
        return [Address(host, port) for endpoint in item.get("endpoints") or ()
                if (endpoint.get("conditions") or {}).get("ready") is not False
                for host in endpoint.get("addresses") or ()]

    def _port(self, ports: list[dict], default_port: int) -> int | None:
        if self.port is not None:
            return self.port
        if self.port_name is not None:  # a slice without that port serves something else
            return next((p["port"] for p in ports if p.get("name") == self.port_name and p.get("port")), None)
        return next((p["port"] for p in ports if p.get("port")), default_port)

    def _api_server(self) -> str:
        if self.api_server:
            return self.api_server.rstrip("/")
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise DiscoveryError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): give api_server")
        return f"https://{f'[{host}]' if ':' in host else host}:{port}"

    def _namespace(self) -> str:
        if self.namespace:
            return self.namespace
        own = SERVICE_ACCOUNT / "namespace"
        return own.read_text().strip() if own.exists() else "default"

    def _auth(self) -> dict[str, str]:
        token = self.token_file or (SERVICE_ACCOUNT / "token" if not self.api_server else None)
        if token is None or not token.exists():
            return {}
        return {"Authorization": f"Bearer {token.read_text().strip()}"}

    def _verify(self) -> ssl.SSLContext | bool:
        ca = self.ca_file or (SERVICE_ACCOUNT / "ca.crt" if not self.api_server else None)
        return ssl.create_default_context(cafile=ca) if ca is not None and ca.exists() else True
