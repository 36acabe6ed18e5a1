"""The serve command's connections: at most ``--max-connections`` are served at once, the others wait (accepted,
not read) for a free slot, and a client that does not send its request headers within ``--header-timeout``
seconds is closed (`ConnectionGate`, `gated_protocol`).

uvicorn's own ``limit_concurrency`` answers 503 at once to any request beyond the limit, so 40 clients that send
half a request and stall starve everyone else until they go. Here a connection beyond the limit is parked instead
(reading paused, its bytes wait in the kernel, the header clock not started) and resumed, oldest first, when an
active one closes; stalled clients are closed by the header timeout (here) and the body timeout (the application,
`detpipe.serve.intake.read_body`), so the slots they held come back within those timeouts. Beyond the limit plus
``max_waiting`` parked connections, a new one is answered 503 at once. This is nginx's and gunicorn's model (a
bounded set of worker connections, the rest waiting in the accept queue, ``client_header_timeout``,
``client_body_timeout``), on uvicorn's h11 protocol (a subclass: uvicorn has no header timeout of its own).
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("detpipe.serve")


class ConnectionGate:
    """Which connections are served (``active``, at most ``limit``) and which wait (``waiting``, first in first out,
    at most ``max_waiting``). Runs on the event loop's thread only: no locks."""

    def __init__(self, limit: int, max_waiting: int):
        self.limit, self.max_waiting = limit, max_waiting
        self.active: set = set()
        self.waiting: collections.deque = collections.deque()

    def arrive(self, conn) -> str:
        """Place a new connection: ``"active"``, ``"waiting"`` or ``"refused"`` (both full)."""
        if len(self.active) < self.limit:
            self.active.add(conn)
            return "active"
        if len(self.waiting) < self.max_waiting:
            self.waiting.append(conn)
            return "waiting"
        return "refused"

    def leave(self, conn) -> list:
        """Forget a closed connection; return the waiting connections now made active (in order)."""
        self.active.discard(conn)
        if conn in self.waiting:
            self.waiting.remove(conn)
        promoted = []
        while self.waiting and len(self.active) < self.limit:
            nxt = self.waiting.popleft()
            self.active.add(nxt)
            promoted.append(nxt)
        return promoted


def _refusal() -> bytes:
    body = json.dumps({"error": "too many connections (--max-connections and its waiting room are full); retry "
                                "later"}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class GatedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol behind a `ConnectionGate`, with a request-header timeout. Configure a subclass with
    `gated_protocol`; uvicorn's ``limit_concurrency`` must be off (the gate replaces it)."""

    gate: ConnectionGate
    header_timeout_s: float = 0.0          # 0: no header timeout
    on_slow_client: Callable[[str], None] = staticmethod(lambda phase: None)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        place = self.gate.arrive(self)
        if place == "active":
            self._arm_header_timer()
        elif place == "waiting":
            transport.pause_reading()
        else:
            log.warning("serve: refused a connection from %s: %d connections served and %d waiting",
                        _peer(self.client), len(self.gate.active), len(self.gate.waiting))
            transport.write(_refusal())
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        promoted = self.gate.leave(self)
        super().connection_lost(exc)
        for conn in promoted:
            conn._activate()

    def _activate(self) -> None:
        """A waiting connection's turn: read it, start its header clock."""
        if self.transport.is_closing():
            return
        self.transport.resume_reading()
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._cancel_header_timer()
        elif self.conn.their_state is h11.IDLE:
            if self._header_timer is None:        # a next request on a kept-alive connection has begun
                self._arm_header_timer()
        else:                                      # headers complete: the application's body timeout takes over
            self._cancel_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        if self.header_timeout_s > 0:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return     # a response is still being written on this connection: not a header wait
        log.warning("serve: closed the connection from %s: request headers not complete within --header-timeout "
                    "%g s", _peer(self.client), self.header_timeout_s)
        self.on_slow_client("headers")
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def gated_protocol(gate: ConnectionGate, header_timeout_s: float,
                   on_slow_client: Callable[[str], None]) -> type[GatedH11Protocol]:
    """A `GatedH11Protocol` class bound to ``gate``, closing clients whose request headers are not complete within
    ``header_timeout_s`` seconds of their turn (0: never), calling ``on_slow_client("headers")`` for each. Pass it
    as ``uvicorn.Config(http=...)``."""
    return type("DetpipeH11Protocol", (GatedH11Protocol,),
                {"gate": gate, "header_timeout_s": header_timeout_s, "on_slow_client": staticmethod(on_slow_client)})
