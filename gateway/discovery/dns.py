"""Replicas from DNS: every A (or, with ``address_type: IPv6``, AAAA) record of a name, as a Kubernetes headless
Service publishes one per ready pod (``clusterIP: None``). Resolved with dnspython: the system's resolver
configuration (search domains included), or the name servers given."""

from __future__ import annotations

import ipaddress
from typing import Literal

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver
from pydantic import Field

from gateway.discovery.source import Address, DiscoveryError, DiscoverySource


class DNSDiscovery(DiscoverySource):
    """``discover: {source: dns, name: vllm-headless.default.svc.cluster.local}``"""

    source: Literal["dns"]
    name: str = Field(min_length=1)  # the name to resolve: a headless Service's, or any with an A/AAAA record per replica
    # "ADDRESS" or "ADDRESS:PORT" of the name servers to ask; default: the system's (/etc/resolv.conf)
    nameservers: list[str] | None = None
    timeout_s: float = Field(2.0, gt=0)  # for one lookup

    async def addresses(self, default_port: int) -> set[Address]:
        resolver = self._resolver()
        port = self.port or default_port
        try:
            answer = await resolver.resolve(self.name, "A" if self.address_type == "IPv4" else "AAAA", search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):  # no replica: an answer, unlike a failed lookup
            return set()
        except dns.exception.DNSException as exc:
            raise DiscoveryError(f"DNS lookup of {self.name} failed: {exc}") from exc
        return {Address(record.address, port) for record in answer}

    def _resolver(self) -> dns.asyncresolver.Resolver:
        try:
            resolver = dns.asyncresolver.Resolver(configure=self.nameservers is None)
        except dns.resolver.NoResolverConfiguration as exc:
            raise DiscoveryError(f"no DNS resolver configuration on this machine: {exc}") from exc
        if self.nameservers is not None:
            resolver.nameservers = [_nameserver(text) for text in self.nameservers]
        resolver.lifetime = self.timeout_s
        return resolver


def _nameserver(text: str) -> dns.nameserver.Nameserver:
    """``ADDRESS``, ``IPv4:PORT`` or ``[IPv6]:PORT``."""
    try:
        return dns.nameserver.Do53Nameserver(str(ipaddress.ip_address(text.strip("[]"))), 53)
    except ValueError:  # an address with a port
        host, _, port = text.rpartition(":")
        return dns.nameserver.Do53Nameserver(str(ipaddress.ip_address(host.strip("[]"))), int(port))
