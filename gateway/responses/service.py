"""The Responses API's request path independent of HTTP: a turn begun (the previous response found, the chat
request built, admitted and routed to where the conversation is held), answered whole, streamed as events, or
run in the background; stored, retrieved, cancelled and deleted per API key."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from backends.base import BackendError, GenerationChunk, InvalidRequestError
from gateway.config import Settings
from gateway.errors import GatewayError, as_gateway_error
from gateway.responses.encoding import ResponseAssembler, response_id
from gateway.responses.requests import ResponsesRequest, chat_messages
from gateway.responses.store import MemoryResponseStore, RedisResponseStore, ResponseStore, StoredResponse
from gateway.routing import Conversation
from gateway.service import Caller, Gateway

log = logging.getLogger(__name__)
RUNNING = ("queued", "in_progress")
CANCEL_WAIT_S = 5.0  # how long a cancel waits for the replica running the response to store what it generated


def not_found(response_id: str, param: str | None = None) -> GatewayError:
    """vLLM's answer for an unknown (or another key's) response id."""
    return GatewayError(404, f"Response with id '{response_id}' not found.", type="invalid_request_error",
                        param=param)


@dataclass
class Turn:
    """One request of a conversation, begun: its generation streaming, its output assembling."""

    body: ResponsesRequest
    owner: str
    assembler: ResponseAssembler
    history: list[dict[str, Any]]  # the conversation before this turn, as chat messages (no instructions)
    conversation: Conversation
    chunks: AsyncGenerator[GenerationChunk, None]
    input_items: list[dict[str, Any]] = field(default_factory=list)  # as stored: each with an id

    def record(self, response: dict[str, Any]) -> StoredResponse:
        """The turn as stored with ``response``: the next turn's history is this one's, its input and its answer."""
        messages = [*self.history, *chat_messages(self.body.input_items()), *self.assembler.output_messages()]
        return StoredResponse(response, self.input_items, messages, self.conversation.served_by)


class Responses:
    """Creates and keeps the responses of one gateway process."""

    def __init__(self, gateway: Gateway, store: ResponseStore) -> None:
        self.gateway = gateway
        self.store = store
        self._background: dict[str, asyncio.Task] = {}
        self._cancels: asyncio.Task | None = None  # follows cancellations announced by other replicas
        self._subscribed = asyncio.Event()  # set once subscribed (or once subscribing failed)

    @classmethod
    def from_settings(cls, gateway: Gateway, settings: Settings) -> Responses:
        cfg = settings.responses
        url = cfg.redis_url or settings.limits.redis_url
        store = RedisResponseStore(url, cfg.retention_s) if url else MemoryResponseStore(cfg.retention_s,
                                                                                          cfg.max_records)
        return cls(gateway, store)

    async def close(self) -> None:
        """Stop background responses (stored as cancelled) and release the store."""
        tasks = list(self._background.values())
        for task in [*tasks, *([self._cancels] if self._cancels else [])]:
            task.cancel()
        await asyncio.gather(*tasks, *([self._cancels] if self._cancels else []), return_exceptions=True)
        await self.store.close()

    # ---------------------------------------------------------------------------------------- create
    async def begin(self, body: ResponsesRequest, caller: Caller) -> Turn:
        """The turn of ``body``: its history loaded, admitted against the caller's limits, routed; errors up to
        here (an unknown ``previous_response_id``, a bad input, a spent limit) are raised before any work."""
        previous = None
        if body.previous_response_id is not None:
            previous = await self.store.get(caller.name, body.previous_response_id)
            if previous is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            if previous.status in RUNNING:
                raise InvalidRequestError(f"Response '{previous.id}' is still {previous.status}: continue it once "
                                          "it has completed.", param="previous_response_id")
        history = previous.messages if previous else []
        rid = response_id()
        generation = body.chat_request(history).generation_request(rid)
        generation.responses = body.relayed(history)
        group = self.gateway.group(body.model)
        caller = await self.gateway.admit(caller, [generation])
        conversation = Conversation(held_by=previous.deployment if previous else None, session=body.prompt_cache_key)
        chunks = self.gateway.generate(group, generation, caller, conversation)
        items = [item.stored() for item in body.input_items()]
        return Turn(body, caller.name, ResponseAssembler(body, rid), history, conversation, chunks, items)

    async def answer(self, turn: Turn) -> dict[str, Any]:
        """The whole response of ``turn``, stored when asked."""
        async with contextlib.aclosing(turn.chunks) as chunks:
            async for chunk in chunks:
                turn.assembler.feed(chunk)
        response = turn.assembler.finish()
        await self._store(turn, response)
        return response

    async def events(self, turn: Turn, head: GenerationChunk | None) -> AsyncIterator[dict[str, Any]]:
        """``turn``'s events: ``head`` (its first chunk, awaited before the response began), then the rest; a
        failure after the first event is ``response.failed``. Stored once completed."""
        a = turn.assembler
        async with contextlib.aclosing(turn.chunks) as chunks:
            for event in a.opening():
                yield event
            try:
                if head is not None:
                    for event in a.feed(head):
                        yield event
                async for chunk in chunks:
                    for event in a.feed(chunk):
                        yield event
            except Exception as exc:  # after the first byte the status is sent: report in-band
                error = as_gateway_error(exc)
                log.info("response %s failed while streaming: %s", a.id, error.message)
                events = a.failed({"code": error.type, "message": error.message})
            else:
                events = a.closing()
            await self._store_streamed(turn, events[-1]["response"])
            for event in events:
                yield event

    async def start_background(self, turn: Turn) -> dict[str, Any]:
        """Store ``turn`` as queued and answer it in a task of its own; the queued response now."""
        queued = turn.assembler.response("queued")
        await self._follow_cancellations()
        rid = turn.assembler.id
        stored = asyncio.Event()  # registered before it is stored: a cancel announced right away finds its task
        self._background[rid] = asyncio.create_task(self._run_background(turn, stored), name=f"response {rid}")
        try:
            await self.store.put(turn.owner, turn.record(queued))
        except BaseException:
            await self._cancel_task(rid)
            raise
        stored.set()
        return queued

    async def _run_background(self, turn: Turn, stored: asyncio.Event) -> None:
        a = turn.assembler
        try:
            await stored.wait()
            await self.store.put(turn.owner, turn.record(a.response("in_progress")))
            async with contextlib.aclosing(turn.chunks) as chunks:
                async for chunk in chunks:
                    a.feed(chunk)
            final = a.finish()
        except asyncio.CancelledError:
            a.closing()
            await self._store_unless_ended(turn, a.response("cancelled"))
            raise
        except Exception as exc:
            error = as_gateway_error(exc)
            final = a.response("failed", {"code": error.type, "message": error.message})
        finally:
            self._background.pop(a.id, None)
        try:
            await self._store_unless_ended(turn, final)
        except BackendError as exc:  # the store is unreachable: nothing else can be done with the answer
            log.error("background response %s ended %s but could not be stored: %s", a.id, final["status"], exc)

    async def _follow_cancellations(self) -> None:
        """With a store other replicas share, listen for the cancellations they announce (from this process's first
        background response on), and return once none can be missed, or once the store has failed to subscribe
        (the response is then taken all the same, and its store write says whether the store is there)."""
        if not self.store.shared:
            return
        if self._cancels is None:
            self._cancels = asyncio.create_task(self._cancel_announced(), name="responses: cancellations")
        await self._subscribed.wait()

    async def _cancel_announced(self) -> None:
        while True:
            try:
                async for rid in self.store.cancellations(self._subscribed.set):
                    if (task := self._background.get(rid)) is not None:
                        task.cancel()  # it stores what it generated as cancelled
            except Exception as exc:  # any failure: said, and subscribed again
                log.warning("cancellations of background responses not followed (%s); subscribing again", exc)
            self._subscribed.set()  # waiting creates go on; their store writes report the store's state
            await asyncio.sleep(1.0)

    async def _store_unless_ended(self, turn: Turn, response: dict[str, Any]) -> None:
        """Write a background turn's outcome unless it was cancelled or deleted meanwhile (from another replica)."""
        current = await self.store.get(turn.owner, turn.assembler.id)
        if current is not None and current.status in RUNNING:
            await self.store.put(turn.owner, turn.record(response))

    async def _store(self, turn: Turn, response: dict[str, Any]) -> None:
        if turn.body.store:
            await self.store.put(turn.owner, turn.record(response))

    async def _store_streamed(self, turn: Turn, response: dict[str, Any]) -> None:
        """Store a streamed response; the stream ends as it would either way if the store is unreachable (its
        status line was sent long ago), so that is logged rather than raised."""
        try:
            await self._store(turn, response)
        except BackendError as exc:
            log.error("response %s was streamed but could not be stored: %s", turn.assembler.id, exc)

    # --------------------------------------------------------------------------------- stored ones
    async def retrieve(self, caller: Caller, rid: str) -> StoredResponse:
        record = await self.store.get(caller.name, rid)
        if record is None:
            raise not_found(rid)
        return record

    async def delete(self, caller: Caller, rid: str) -> dict[str, Any]:
        """Forget a stored response (a background one still running is cancelled first)."""
        record = await self.retrieve(caller, rid)
        if record.status in RUNNING and not await self._cancel_task(rid) and self.store.shared:
            await self.store.announce_cancel(rid)  # another replica runs it: deleted once that one has stopped
            await self._until_ended(caller, rid)
        await self.store.delete(caller.name, rid)
        return {"id": rid, "object": "response", "deleted": True}

    async def cancel(self, caller: Caller, rid: str) -> dict[str, Any]:
        """Cancel a background response, here or on the replica running it; one that has ended already is returned
        as it is."""
        record = await self.retrieve(caller, rid)
        if not record.response.get("background"):
            raise InvalidRequestError("Cannot cancel a synchronous response.", param="response_id")
        if record.status in RUNNING:
            # here, its task stores what it generated as cancelled; elsewhere, that replica's task does
            if not await self._cancel_task(rid) and self.store.shared:
                await self.store.announce_cancel(rid)
                await self._until_ended(caller, rid)
            record = await self.retrieve(caller, rid)
            if record.status in RUNNING:  # queued on a replica that has gone, or not running anywhere
                record.response["status"] = "cancelled"
                await self.store.put(caller.name, record)
        return record.response

    async def _until_ended(self, caller: Caller, rid: str) -> None:
        """Wait until the record is no longer running, for at most ``CANCEL_WAIT_S``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CANCEL_WAIT_S
        while (await self.retrieve(caller, rid)).status in RUNNING and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def _cancel_task(self, rid: str) -> bool:
        task = self._background.get(rid)
        if task is None:
            return False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, BackendError):
            await task
        return True
