"""What every discovery source shares: the address of a replica, the lookup's failure, the settings' base."""

from __future__ import annotations

import abc
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field


class Address(NamedTuple):
    host: str  # an IP address, as the source gives it
    port: int


class DiscoveryError(Exception):
    """The lookup failed (unlike an answer of no replicas): the replicas known so far are kept."""


class DiscoverySource(BaseModel, abc.ABC):
    """A source's settings; ``addresses`` looks the replicas up once."""

    model_config = ConfigDict(extra="forbid")

    interval_s: float = Field(10.0, gt=0)  # how often the replicas are looked up again
    port: int | None = Field(None, ge=1, le=65535)  # default: the source's own, else the template url's
    # the addresses taken (EndpointSlice's words): a dual-stack pod has one of each, and is one replica
    address_type: Literal["IPv4", "IPv6"] = "IPv4"

    @abc.abstractmethod
    async def addresses(self, default_port: int) -> set[Address]:
        """The replicas there are now; raises ``DiscoveryError`` when the lookup itself fails."""
