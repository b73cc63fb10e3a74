"""Stored responses: the Response object, its input items, the conversation up to it and who answered it.

Every record belongs to the API key that created it (``owner``): a key reads, continues, cancels and deletes
only its own, and any other id is "not found" (never "forbidden": ids of other keys are not confirmed to exist).
Records expire ``retention_s`` after their last write. ``MemoryResponseStore`` keeps them in this process (and at
most ``max_records``, oldest dropped first); ``RedisResponseStore`` in Redis, where every gateway replica finds
them, so that a conversation may continue through any replica, and where a replica asked to cancel a background
response that another replica runs announces it to them all (``announce_cancel``, ``cancellations``).
"""

from __future__ import annotations

import abc
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from backends.base import UnavailableError


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as last written
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this turn's input items, with their ids
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation through this answer (chat)
    deployment: str | None = None  # the deployment that answered: its KV cache holds the conversation

    @property
    def id(self) -> str:
        return self.response["id"]

    @property
    def status(self) -> str:
        return self.response["status"]

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str | bytes) -> StoredResponse:
        return cls(**json.loads(text))


class ResponseStore(abc.ABC):
    """Where stored responses live; one instance per gateway process."""

    shared = False  # whether other gateway processes use the same records (and so may run their responses)

    def __init__(self, retention_s: float) -> None:
        self.retention_s = retention_s

    @abc.abstractmethod
    async def put(self, owner: str, record: StoredResponse) -> None:
        """Write ``record`` (a new one, or the same id again as its status changes)."""

    @abc.abstractmethod
    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """``owner``'s record of ``response_id``, or None (unknown, expired, or another key's)."""

    @abc.abstractmethod
    async def delete(self, owner: str, response_id: str) -> bool:
        """Remove ``owner``'s record; whether there was one."""

    async def announce_cancel(self, response_id: str) -> None:  # noqa: B027 (a hook: no other process to tell)
        """Ask whichever gateway process sharing this store runs ``response_id`` to stop it."""

    async def cancellations(self, subscribed: Callable[[], None]) -> AsyncIterator[str]:
        """The response ids announced to be cancelled, by any process sharing the store, for as long as it is open;
        ``subscribed`` is called once none announced from then on can be missed. Only a shared store has any."""
        raise NotImplementedError("only a shared store announces cancellations")
        yield  # an async generator

    async def close(self) -> None:  # noqa: B027 (a hook: the memory store holds nothing to release)
        """Release connections."""


class MemoryResponseStore(ResponseStore):
    def __init__(self, retention_s: float, max_records: int = 10_000) -> None:
        super().__init__(retention_s)
        self.max_records = max_records
        self._records: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()

    async def put(self, owner: str, record: StoredResponse) -> None:
        key = (owner, record.id)
        self._records[key] = (time.monotonic() + self.retention_s, record.dumps())
        self._records.move_to_end(key)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        entry = self._records.get((owner, response_id))
        if entry is None:
            return None
        if entry[0] < time.monotonic():
            del self._records[(owner, response_id)]
            return None
        return StoredResponse.loads(entry[1])

    async def delete(self, owner: str, response_id: str) -> bool:
        if await self.get(owner, response_id) is None:  # unknown or expired
            return False
        del self._records[(owner, response_id)]
        return True


class RedisResponseStore(ResponseStore):
    """One string key per record, ``burstgate:response:<owner>:<id>``, expiring with the record; cancellations are
    published on the channel ``burstgate:responses:cancel``."""

    shared = True
    CHANNEL = "burstgate:responses:cancel"

    def __init__(self, url: str, retention_s: float, timeout_s: float = 2.0) -> None:
        super().__init__(retention_s)
        import redis.asyncio as redis

        self._redis = redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        # a subscriber waits for messages as long as there are none: a connection without the commands' timeout
        self._subscriber = redis.from_url(url, socket_connect_timeout=timeout_s, health_check_interval=30)
        self._errors = (redis.ConnectionError, redis.TimeoutError)

    @staticmethod
    def _key(owner: str, response_id: str) -> str:
        return f"burstgate:response:{owner}:{response_id}"

    async def put(self, owner: str, record: StoredResponse) -> None:
        await self._call(self._redis.set, self._key(owner, record.id), record.dumps(), ex=max(1, int(self.retention_s)))

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        text = await self._call(self._redis.get, self._key(owner, response_id))
        return None if text is None else StoredResponse.loads(text)

    async def delete(self, owner: str, response_id: str) -> bool:
        return bool(await self._call(self._redis.delete, self._key(owner, response_id)))

    async def announce_cancel(self, response_id: str) -> None:
        await self._call(self._redis.publish, self.CHANNEL, response_id)

    async def cancellations(self, subscribed: Callable[[], None]) -> AsyncIterator[str]:
        pubsub = self._subscriber.pubsub()
        try:
            await self._call(pubsub.subscribe, self.CHANNEL)
            subscribed()
            while True:  # a finite wait, so that the connection's health is checked between messages
                message = await self._call(pubsub.get_message, ignore_subscribe_messages=True, timeout=10.0)
                if message is not None and message["type"] == "message":
                    yield message["data"].decode()
        finally:
            await pubsub.aclose()

    async def _call(self, method, *args, **kwargs):
        """A Redis command; Redis out of reach is a 503 (stored responses are not kept elsewhere meanwhile)."""
        try:
            return await method(*args, **kwargs)
        except self._errors as exc:
            raise UnavailableError(f"the response store (Redis) is unreachable: {exc}") from None

    async def close(self) -> None:
        await self._redis.aclose()
        await self._subscriber.aclose()
