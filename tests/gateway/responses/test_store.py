"""Stored responses, in memory and in a real Redis: per key, expiring, deletable; Redis gone is a 503, not a 500."""

from __future__ import annotations

import asyncio

import pytest

from backends.base import UnavailableError
from gateway.responses.store import MemoryResponseStore, RedisResponseStore, StoredResponse
from tests.servers import free_port, redis_server


def record(rid="resp_1", status="completed"):
    return StoredResponse({"id": rid, "status": status, "output": []}, [{"id": "msg_1", "type": "message"}],
                          [{"role": "user", "content": "Hi"}], "native-0")


@pytest.fixture(params=["memory", "redis"])
def make_store(request):
    if request.param == "memory":
        yield MemoryResponseStore
        return
    with redis_server() as url:
        yield lambda retention_s: RedisResponseStore(url, retention_s)


def test_a_key_reads_only_its_own_records(make_store):
    async def run():
        store = make_store(3600)
        await store.put("alice", record())
        assert (await store.get("alice", "resp_1")) == record()
        assert await store.get("bob", "resp_1") is None
        assert not await store.delete("bob", "resp_1")
        assert await store.delete("alice", "resp_1")
        assert await store.get("alice", "resp_1") is None
        await store.close()

    asyncio.run(run())


def test_a_record_is_rewritten_as_its_status_changes(make_store):
    async def run():
        store = make_store(3600)
        await store.put("alice", record(status="queued"))
        await store.put("alice", record(status="completed"))
        assert (await store.get("alice", "resp_1")).status == "completed"
        await store.close()

    asyncio.run(run())


def test_records_expire_after_their_retention(make_store):
    async def run():
        store = make_store(1)
        await store.put("alice", record())
        await asyncio.sleep(2.2)
        assert await store.get("alice", "resp_1") is None
        await store.close()

    asyncio.run(run())


def test_memory_keeps_at_most_max_records_oldest_dropped_first():
    async def run():
        store = MemoryResponseStore(3600, max_records=2)
        for i in range(3):
            await store.put("alice", record(f"resp_{i}"))
        assert [await store.get("alice", f"resp_{i}") is not None for i in range(3)] == [False, True, True]

    asyncio.run(run())


def test_redis_out_of_reach_is_unavailable():
    async def run():
        store = RedisResponseStore(f"redis://127.0.0.1:{free_port()}/0", 3600, timeout_s=0.2)
        with pytest.raises(UnavailableError, match="response store"):
            await store.get("alice", "resp_1")
        await store.close()

    asyncio.run(run())
