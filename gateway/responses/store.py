"""Stored responses: the Response object, its input items, the conversation up to it and who answered it.

Every record belongs to the API key that created it (``owner``): a key reads, continues, cancels and deletes
only its own, and any other id is "not found" (never "forbidden": ids of other keys are not confirmed to exist).
Records expire ``retention_s`` after their last write. ``MemoryResponseStore`` keeps them in this process (and at
most ``max_records``, oldest dropped first); ``RedisResponseStore`` in Redis, where every gateway replica finds
them, so that a conversation may continue through any replica.
"""

from __future__ import annotations

import abc
import json
import time
from collections import OrderedDict
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
    """One string key per record, ``burstgate:response:<owner>:<id>``, expiring with the record."""

    def __init__(self, url: str, retention_s: float, timeout_s: float = 2.0) -> None:
        super().__init__(retention_s)
        import redis.asyncio as redis

        self._redis = redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
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

    async def _call(self, method, *args, **kwargs):
        """A Redis command; Redis out of reach is a 503 (stored responses are not kept elsewhere meanwhile)."""
        try:
            return await method(*args, **kwargs)
        except self._errors as exc:
            raise UnavailableError(f"the response store (Redis) is unreachable: {exc}") from None

    async def close(self) -> None:
        await self._redis.aclose()
