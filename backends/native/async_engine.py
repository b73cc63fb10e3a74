"""Runs ``LLMEngine`` steps in one background thread and serves many asyncio callers.

Callers never touch the engine: they post add/abort commands to a thread-safe inbox and receive their
outputs on an ``asyncio.Queue`` fed with ``call_soon_threadsafe`` once per step. Closing a caller's
iterator (client gone, task cancelled) posts an abort, so the sequence's KV blocks are freed at the
next step boundary.

If the engine thread itself dies (an error outside a step, one that is not an ``Exception``, or any
step error once a tensor-parallel worker is gone), the backend is dead for good: ``dead`` holds the cause, every caller's stream ends with ``UnavailableError``
(503), new requests are refused with it, and ``alive`` turns false so health checks mark it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import ClassVar

from backends.base import GenerationChunk, SamplingParams, UnavailableError, UpstreamError
from backends.native.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """The one thread that steps an ``LLMEngine``. Backends serving the same engine share it (``attach``): two
    threads stepping one engine would schedule the same sequences twice."""

    _drivers: ClassVar[dict[int, tuple[AsyncEngine, int]]] = {}  # id(engine) -> (its driver, backends attached)
    _drivers_lock = threading.Lock()

    @classmethod
    def attach(cls, engine: LLMEngine) -> AsyncEngine:
        """``engine``'s driver, started on first use; every ``attach`` is paired with a ``detach``."""
        with cls._drivers_lock:
            driver, users = cls._drivers.get(id(engine), (None, 0))
            if driver is None or driver.engine is not engine or driver.dead is not None:  # none yet, or it died
                driver, users = cls(engine), 0
            cls._drivers[id(engine)] = (driver, users + 1)
            return driver

    def detach(self) -> None:
        """One backend is done with the driver; the last one stops its thread."""
        with self._drivers_lock:
            driver, users = self._drivers.get(id(self.engine), (None, 0))
            if driver is self and users > 1:
                self._drivers[id(self.engine)] = (self, users - 1)
                return
            if driver is self:
                del self._drivers[id(self.engine)]
        self.close()

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="native-engine", daemon=True)
        self._thread.start()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncGenerator[GenerationChunk, None]:
        """Chunks of one request (of its ``n`` choices) as they are produced; raises ``InvalidRequestError`` up
        front (the one validation a request gets). A structured output's grammar is compiled here, in a
        worker thread, before the request reaches the engine: the engine thread never waits for it."""
        self._raise_if_dead()
        self.engine.check_request(prompt_ids, params)
        grammar = None
        if params.structured is not None:
            grammar = await asyncio.to_thread(self.engine.compile_grammar, params.structured)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        finished, unfinished_choices = False, params.n
        try:
            self._raise_if_dead()  # again: the thread may have died, and failed every stream, meanwhile
            self._post(("add", request_id, prompt_ids, params, grammar))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                unfinished_choices -= item.finish_reason is not None
                if not unfinished_choices:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(("abort", request_id))

    def _raise_if_dead(self) -> None:
        if self.dead is not None:
            raise UnavailableError(f"native engine thread died: {self.dead!r}")

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread.is_alive() and self.engine.alive

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    # ------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.critical("native engine thread died; failing every request", exc_info=exc)
            self._die(exc)

    def _loop(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug or OOM: fail every request, keep serving new ones
                if not self.engine.alive:  # a tensor-parallel worker died: nothing more can run
                    raise
                log.exception("engine step failed")
                self._fail_all(UpstreamError(f"engine step failed: {exc}"))
                continue
            self._deliver(outputs)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt_ids, params, grammar = command
                if request_id not in self._streams:
                    continue  # the caller left before the engine saw the request
                try:
                    self.engine.add_request(request_id, prompt_ids, params, grammar)
                except Exception as exc:
                    self._send(request_id, exc)
            else:
                self.engine.abort_request(command[1])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerationChunk]]] = {}
        for request_id, chunk in outputs:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, chunk))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _send(self, request_id: str, item: object) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            _call_soon(stream.loop, stream.queue.put_nowait, item)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in self.engine.request_ids():
            self.engine.abort_request(request_id)
            self._send(request_id, exc)

    def _die(self, exc: BaseException) -> None:
        """Mark the engine dead first (``generate`` checks it after registering), then end every stream
        and free what the engine still holds, as far as it still can."""
        self.dead = exc
        error = UnavailableError(f"native engine thread died: {exc!r}")
        for request_id in list(self._streams):
            self._send(request_id, error)
        for request_id in self.engine.request_ids():
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine's own state may be what broke
                log.exception("could not abort %s after the engine thread died", request_id)


def _put_all(items: list[tuple[asyncio.Queue, GenerationChunk]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening any more
        loop.call_soon_threadsafe(fn, *args)
