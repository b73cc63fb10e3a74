"""Replicas from DNS: every A and AAAA record of a name, as a Kubernetes headless Service publishes one per ready
pod (``clusterIP: None``). Resolved with dnspython: the system's resolver configuration (search domains
included), or the name servers given."""

from __future__ import annotations

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
    name: str = Field(min_length=1)
    # "ADDRESS" or "ADDRESS:PORT" of the name servers to ask; default: the system's (/etc/resolv.conf)
    nameservers: list[str] | None = None
    timeout_s: float = Field(2.0, gt=0)

    async def addresses(self, default_port: int) -> set[Address]:
        resolver = self._resolver()
        port = self.port or default_port
        found: set[Address] = set()
        for rdtype in ("A", "AAAA"):
            try:
                answer = await resolver.resolve(self.name, rdtype, search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):  # no replica (of this family): an answer
                continue
            except dns.exception.DNSException as exc:
                raise DiscoveryError(f"DNS lookup of {self.name} failed: {exc}") from exc
            found |= {Address(record.address, port) for record in answer}
        return found

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
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port or (host.count(":") > 1 and not host.startswith("[")):  # no port, or a bare IPv6 address
        return dns.nameserver.Do53Nameserver(text.strip("[]"), 53)
    return dns.nameserver.Do53Nameserver(host.strip("[]"), int(port))
