"""Graceful shutdown: what one gateway process does between SIGTERM and its exit.

A pod being replaced gets SIGTERM while load balancers may still send it traffic for a moment, and while its
streams are still running. So, on SIGTERM:

1. ``/ready`` answers 503 at once (load balancers and Kubernetes stop choosing this process);
2. new requests are still served for ``server.drain_grace_s`` while endpoints update, then the server stops
   accepting connections (uvicorn's own shutdown: the listener closed, idle keep-alive connections closed);
3. requests in flight run to their end until ``server.drain_timeout_s`` after the signal; those still running
   then end with a 503 ``server_shutting_down`` error, in-band for a stream that began, never a cut connection;
4. the engines stop after the last request (the app's lifespan shutdown).

A second SIGTERM skips what is left of the grace window.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable

from backends.base import UnavailableError

log = logging.getLogger(__name__)


class ShuttingDown(UnavailableError):
    """The request was still running when the drain deadline passed (never retried: every deployment of this
    process is going away)."""

    kind = "shutting_down"

    def __init__(self) -> None:
        super().__init__("The server is shutting down: this request did not finish before its drain deadline; "
                         "retry it.", code="server_shutting_down")


class Drain:
    """The drain state of one process and the requests it may have to end (see the module's docstring)."""

    def __init__(self, grace_s: float, timeout_s: float) -> None:
        self.grace_s, self.timeout_s = grace_s, timeout_s
        self.draining = False
        self.deadline_passed = False
        self._waiting: set[asyncio.Task] = set()  # tasks awaiting a backend's next chunk
        self._cut: set[asyncio.Task] = set()  # of those, the ones cancelled by the deadline

    async def next_chunk(self, awaitable):
        """``await awaitable`` (a backend's next chunk), ended by ``ShuttingDown`` at the drain deadline."""
        if self.deadline_passed:
            raise ShuttingDown()
        task = asyncio.current_task()
        self._waiting.add(task)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if task in self._cut:
                self._cut.discard(task)
                if task.uncancel() == 0:  # cancelled by the deadline alone, not from outside as well
                    raise ShuttingDown() from None
            raise
        finally:
            self._waiting.discard(task)

    def begin(self, stop_accepting: Callable[[], None]) -> None:
        """Start draining (in the event loop): readiness fails now, ``stop_accepting`` runs after the grace
        window, requests still running at the deadline are ended."""
        if self.draining:  # a second signal: no more grace
            stop_accepting()
            return
        self.draining = True
        log.warning("draining: not ready; serving new requests %.3g s more, in-flight ones up to %.3g s",
                    self.grace_s, self.timeout_s)
        loop = asyncio.get_running_loop()
        loop.call_later(self.grace_s, stop_accepting)
        loop.call_later(self.timeout_s, self.end_in_flight)

    def end_in_flight(self) -> None:
        """The deadline: every request still waiting on a backend ends with ``ShuttingDown``."""
        self.deadline_passed = True
        if self._waiting:
            log.warning("drain deadline passed: ending %d request(s) still running", len(self._waiting))
        for task in list(self._waiting):
            self._cut.add(task)
            task.cancel()

    def take_over_sigterm(self) -> None:
        """Route this process's SIGTERM through ``begin``; the server's own handler (uvicorn's: stop accepting,
        wait for connections, shut the app down) runs once the grace window is over. Only where signals can be
        handled (the main thread, with a Python-level handler installed by the server)."""
        previous = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is not threading.main_thread() or not callable(previous):
            return
        loop = asyncio.get_running_loop()

        def on_sigterm(signum, frame) -> None:
            loop.call_soon_threadsafe(self.begin, lambda: previous(signum, frame))

        signal.signal(signal.SIGTERM, on_sigterm)
