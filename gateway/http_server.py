"""uvicorn, with the limits it lacks against hostile clients.

uvicorn times out only idle keep-alive connections, and that timer is disarmed by any byte received: a
client trickling its headers or body, or opening a connection and sending nothing, holds it for ever
(slowloris), and httptools accepts headers of any size. ``GuardedHttpToolsProtocol`` (uvicorn's
httptools protocol, passed as its ``http`` class) adds, per ``Server`` settings:

- a deadline to receive a whole request, from its first byte (or the connection's opening) until its
  body is in; then 408 and the connection closed. Streaming a long answer is never affected;
- a cap on the request line and headers (431);
- a cap on open connections: at the cap a new connection closes the one idle for longest (no request
  under way on it), or is answered 503 when none is idle;
- every TLS close bounded to a short grace (the server's stop, eviction, the keep-alive timeout, an answer
  without keep-alive), where asyncio waits 30 s for a client that is not reading.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import Server

log = logging.getLogger(__name__)
# How long a TLS connection being closed may wait for its client: enough to send an answer still buffered to a
# client that reads, far below asyncio's 30 s wait for a close_notify that an idle client never sends
TLS_CLOSE_GRACE_S = 5.0


def uvicorn_options(server: Server) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config``: our protocol, our access log (with
    request ids, gateway/access_log.py) instead of uvicorn's, and our logging configuration."""
    return {"http": functools.partial(GuardedHttpToolsProtocol, limits=server),
            "timeout_keep_alive": server.keep_alive_timeout_s, "access_log": False, "log_config": None,
            # --workers: a worker answers the supervisor's pings only once it has imported torch and the
            # engines (seconds); uvicorn's 5 s killed every worker of a busy machine before it started
            "timeout_worker_healthcheck": 60,
            # a backstop only: the drain (gateway/drain.py) ends what still runs at its deadline, before this
            # cancels the connections' tasks outright
            "timeout_graceful_shutdown": server.drain_timeout_s + 5}


def _response(status: int, reason: str) -> bytes:
    body = f"{status} {reason}".encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args, limits: Server, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes received while a request head is incomplete (an upper bound of its size)
        self._in_head = True
        self._idle_since: float | None = None  # set while no request is under way
        self._refused = False
        self._abort_later: asyncio.TimerHandle | None = None  # a TLS close's bound (_bound_tls_close)

    # --------------------------------------------------------------------------------- connection
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._idle_since = time.monotonic()
        self._arm()
        if len(self.connections) > self.limits.max_connections and not self._evict_idle():
            log.warning("%d connections open: refusing a new one", len(self.connections))
            self._refuse(503, "Service Unavailable")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:  # counted per read, not per header: the parser's callbacks run for every request
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:  # all of it head: no end seen
            self._refuse(431, "Request Header Fields Too Large")

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # after our own refusal the parser's error is expected
            super().send_400_response(msg)

    # ------------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._idle_since = None
        if self._deadline is None:  # the first request's deadline runs from the connection's opening
            self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_bytes > self.limits.max_header_bytes:  # the reads held a body too: measure the head itself
            size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
            if size > self.limits.max_header_bytes:
                self._refuse(431, "Request Header Fields Too Large")
                raise ValueError("request head too large")  # stops the parser (uvicorn's 400 is suppressed)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes = True, 0  # what comes next is the next request's head
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        super().on_response_complete()
        self._bound_tls_close()  # an answer without keep-alive (the server stopping, Connection: close) closed it

    def shutdown(self) -> None:
        """The server stops (after the drain): an idle connection is closed now, one answering after its answer;
        over TLS neither waits for the client past ``TLS_CLOSE_GRACE_S``."""
        super().shutdown()
        self._bound_tls_close()

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self._bound_tls_close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._abort_later is not None:
            self._abort_later.cancel()
        super().connection_lost(exc)

    def _close_idle(self) -> None:
        """Close an idle connection (evicted at the cap), over TLS for at most ``TLS_CLOSE_GRACE_S``."""
        self.transport.close()
        self._bound_tls_close()

    def _bound_tls_close(self) -> None:
        """If the connection is closing over TLS: a TLS close sends what is still buffered, then waits for the
        client's close_notify, which a client idle in its pool sends only when it next reads: asyncio waits 30 s
        for it, the stop of a drained server and a slot of the connection cap with it. Past the grace, the
        connection is aborted."""
        if (self._abort_later is None and self.transport.is_closing()
                and self.transport.get_extra_info("sslcontext") is not None):
            self._abort_later = self.loop.call_later(TLS_CLOSE_GRACE_S, self.transport.abort)

    # ------------------------------------------------------------------------------------ limits
    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.limits.request_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.response_started:
            self.transport.close()  # an answer is already on its way: nothing else can be said
        else:
            self._refuse(408, "Request Timeout")

    def _refuse(self, status: int, reason: str) -> None:
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self.transport.write(_response(status, reason))
        self.transport.close()

    def _evict_idle(self) -> bool:
        """Close the connection idle for longest (not this one); False when none is idle."""
        idle = [c for c in self.connections if c is not self and getattr(c, "_idle_since", None) is not None
                and not c.transport.is_closing()]  # one closing already frees its slot
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._idle_since)  # type: ignore[union-attr]  # set by our protocol only
        oldest._idle_since = None  # type: ignore[union-attr]
        oldest._close_idle()  # type: ignore[union-attr]
        return True
