"""One discovered deployment template's replicas, kept in step with what its source finds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from gateway.discovery.source import Address, DiscoveryError

if TYPE_CHECKING:
    from gateway.deployments import Deployment
    from gateway.routing import ModelGroup

log = logging.getLogger(__name__)


class Membership:
    """The replicas of ``template`` (a deployment config with ``discover:``) in ``group``: ``join`` builds, starts and
    adds one for a new address; ``leave`` takes one out (it finishes what it runs, then closes)."""

    def __init__(self, group: ModelGroup, template: Any, name: str,
                 join: Callable[[ModelGroup, Any], Awaitable[Deployment]],
                 leave: Callable[[ModelGroup, Deployment], None]) -> None:
        self.group, self.template, self.name = group, template, name
        self.source = template.discover
        self._join, self._leave = join, leave
        self.members: dict[Address, Deployment] = {}
        url = urlsplit(template.url)
        self._default_port = url.port or (443 if url.scheme == "https" else 80)

    async def refresh(self) -> None:
        """Look the replicas up once: new ones join, gone ones leave; a failed lookup changes nothing."""
        try:
            found = await self.source.addresses(self._default_port)
        except DiscoveryError as exc:
            log.warning("%s: keeping its %d replica(s): %s", self.name, len(self.members), exc)
            return
        for address in sorted(found - self.members.keys()):
            try:
                self.members[address] = await self._join(self.group, self.replica(address))
            except Exception:  # a replica that cannot start is tried again at the next lookup
                log.exception("%s: replica %s:%d could not join", self.name, *address)
        for address in sorted(self.members.keys() - found):
            self._leave(self.group, self.members.pop(address))

    async def run(self) -> None:
        """``refresh`` every ``interval_s``, for as long as the gateway serves."""
        while True:
            await asyncio.sleep(self.source.interval_s)
            await self.refresh()

    def replica(self, address: Address) -> Any:
        """The template's config for the replica at ``address``: its URL's host and port, a name of its own, its
        KV events endpoint's ``{host}`` filled in."""
        host = f"[{address.host}]" if ":" in address.host else address.host
        url = urlsplit(self.template.url)
        netloc = f"{url.netloc.rpartition('@')[0]}@" if "@" in url.netloc else ""
        update = {"url": urlunsplit(url._replace(netloc=f"{netloc}{host}:{address.port}")), "discover": None,
                  "name": f"{self.name}@{host}:{address.port}"}
        if url.scheme == "https" and self.template.tls_server_name is None:
            update["tls_server_name"] = url.hostname  # the certificate names the Service, not the pod's address
        if self.template.kv_events:
            update["kv_events"] = self.template.kv_events.replace("{host}", host)
        return self.template.model_copy(update=update)
