"""KV-cache events in vLLM's wire format (vllm/distributed/kv_events.py), so that routers follow what an engine
holds: the native engine publishes them as vLLM 0.32 does, and the gateway's cache-aware routing reads vLLM's and
ours alike (and any reader of vLLM's, such as vllm-router's ``kv_aware`` policy, reads ours).

On the wire: a ZMQ PUB socket sends multipart messages ``[topic, seq, payload]``: ``seq`` 8 bytes big-endian,
counting up from 0; ``payload`` msgpack of a ``KVEventBatch`` encoded by position (msgspec ``array_like``):
``[ts, [event, ...], data_parallel_rank]``; each event a map tagged by its ``type``: ``{"type": "BlockStored",
"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}``,
``{"type": "BlockRemoved", "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}`` (vLLM's optional fields,
at their defaults, are left out as vLLM leaves them). Older vLLMs wrote each event as a tagged array by
position (``["BlockStored", block_hashes, ...]``); the reader takes both. Block hashes are the engine's own names
for its blocks (bytes or ints).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

log = logging.getLogger(__name__)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # these three have no default in vLLM: always written, null when unset
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# The fields of each event by position, as older vLLMs wrote them (tagged arrays)
_BY_POSITION = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
                "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}
_EVENTS = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
_REQUIRED = {"BlockStored": ("block_hashes", "token_ids", "block_size"), "BlockRemoved": ("block_hashes",),
             "AllBlocksCleared": ()}  # an event without these says nothing the index can use


def decode_events(payload: bytes) -> list[KVCacheEvent]:
    """The events of one payload, as vLLM 0.32 writes them (tagged maps) or as older vLLMs did (tagged arrays);
    fields the event classes here do not know are ignored, unknown event kinds skipped."""
    batch = msgspec.msgpack.decode(payload)
    events: list[KVCacheEvent] = []
    for raw in batch[1] if isinstance(batch, list) and len(batch) > 1 else []:
        if isinstance(raw, dict):
            kind, fields = str(raw.get("type")), raw
        elif isinstance(raw, list) and raw and raw[0] in _BY_POSITION:
            kind, fields = raw[0], dict(zip(_BY_POSITION[raw[0]], raw[1:], strict=False))
        else:
            continue
        if (cls := _EVENTS.get(kind)) is not None:
            known = {name: fields.get(name) for name in cls.__struct_fields__}
            if all(known.get(name) is not None for name in _REQUIRED[kind]):
                events.append(cls(**known))
    return events


@dataclass
class ZmqEventPublisher:
    """Publishes batches on a ZMQ PUB socket bound to ``endpoint`` (vLLM's default ``tcp://*:5557``) from a thread
    of its own, so the engine's step never waits for the network."""

    endpoint: str
    topic: str = ""

    def __post_init__(self) -> None:
        import zmq

        self._context: zmq.Context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.bind(self.endpoint)
        self._queue: queue.SimpleQueue[KVEventBatch | None] = queue.SimpleQueue()
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._send_all, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def bound(self) -> str:
        """The endpoint as bound (a ``*`` port resolved), for readers to connect to."""
        import zmq

        return self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, batch: KVEventBatch) -> None:
        self._queue.put(batch)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._socket.close(linger=0)

    def _send_all(self) -> None:
        seq = 0
        topic = self.topic.encode()
        while (batch := self._queue.get()) is not None:
            self._socket.send_multipart((topic, seq.to_bytes(8, "big"), self._encoder.encode(batch)))
            seq += 1


async def follow(endpoint: str, topic: str, on_events: Callable[[list[KVCacheEvent]], Any],
                 on_gap: Callable[[int], Any] = lambda missed: None,
                 on_restart: Callable[[], Any] = lambda: None) -> None:
    """Read the events published at ``endpoint`` (ZMQ SUB, reconnecting by itself) until cancelled, handing each
    batch's events to ``on_events``; ``on_gap`` hears how many batches were missed when the sequence jumps ahead,
    ``on_restart`` that it began again (the engine restarted: its cache is empty)."""
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.IPV6, 1)  # tcp://[fd00::5]:5557 too (IPv4 addresses work as before)
    socket.setsockopt_string(zmq.SUBSCRIBE, topic)
    socket.connect(endpoint)
    expected = None
    try:
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if expected is not None and seq > expected:
                on_gap(seq - expected)
            elif expected is not None and seq < expected:
                on_restart()
            expected = seq + 1
            try:
                events = decode_events(frames[2])
            except msgspec.DecodeError:
                log.warning("KV events from %s: a payload that is not msgpack", endpoint)
                continue
            on_events(events)
    finally:
        socket.close(linger=0)
