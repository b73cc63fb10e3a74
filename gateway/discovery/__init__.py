"""Replicas discovered, not listed: a deployment with ``discover:`` is a template, and the replicas behind it are
what a DNS name resolves to (a Kubernetes headless Service: ``dns.py``) or the ready endpoints of the
EndpointSlices a label selector picks (the Kubernetes API: ``kubernetes.py``), read again every ``interval_s``.
``membership.py`` keeps the model group in step: a replica that appears joins routing (and the routing policy's
index), one that goes takes no new request, finishes what it runs, and is closed. A failed lookup keeps the
replicas known until the next one succeeds.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gateway.discovery.dns import DNSDiscovery
from gateway.discovery.kubernetes import KubernetesDiscovery
from gateway.discovery.source import Address, DiscoveryError

DiscoveryConfig = Annotated[DNSDiscovery | KubernetesDiscovery, Field(discriminator="source")]

__all__ = ["Address", "DNSDiscovery", "DiscoveryConfig", "DiscoveryError", "KubernetesDiscovery"]
