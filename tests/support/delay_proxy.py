"""A TCP proxy on 127.0.0.1 that adds a first-byte latency to every response and counts the requests in flight,
for the streaming tests and ``benchmarks.s3_stream`` (object storage seen from a cloud machine: AWS S3 from EC2
answers with a typical 20-50 ms first-byte latency)::

    with DelayProxy(("127.0.0.1", s3_port), delay_s=0.05) as proxy:
        url = f"s3://bucket/cache?endpoint_override=127.0.0.1:{proxy.port}&scheme=http"
        ...                                  # proxy.responses, proxy.max_in_flight

HTTP/1.1 without pipelining is assumed (what S3 clients send): on one connection, bytes from the client start a
request, and the next bytes from the server are its response.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

START_S = float(os.environ.get("DETPIPE_TEST_PROXY_START_S", "60"))
"""Seconds a `DelayProxy` may take to listen (``$DETPIPE_TEST_PROXY_START_S``): a bound for a loaded machine."""


class DelayProxy:
    """Forward 127.0.0.1:``port`` (a free port) to ``upstream`` ``(host, port)``, holding back the first byte of each
    response for ``delay_s`` seconds (settable at any time). Runs an asyncio loop in a daemon thread; `close` (or
    leaving the ``with`` block) closes every connection and stops it, printing nothing.

    Counters (read from any thread; `reset` zeroes them):
        responses: responses started, i.e. HTTP requests answered.
        in_flight: requests sent upstream whose response's first byte has not yet been passed on (the delay
            included), i.e. requests the client is waiting for right now.
        max_in_flight: the most ``in_flight`` seen since the last `reset`.
    Raises:
        RuntimeError: the proxy's thread failed to listen (its error), or its socket did not come up within
            ``START_S`` seconds (a bound for a loaded machine, not a proxy for anything: listening takes milliseconds).
    """

    def __init__(self, upstream: tuple[str, int], delay_s: float = 0.0):
        self.upstream, self.delay_s = upstream, float(delay_s)
        self.responses = self.in_flight = self.max_in_flight = 0
        self.port = 0
        self._handlers: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def start():
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()

        self._thread = threading.Thread(target=self._run, args=(start,), name="delay-proxy", daemon=True)
        self._error: BaseException | None = None
        self._thread.start()
        deadline = time.monotonic() + START_S
        while not ready.wait(0.1):  # until it listens, or its thread is gone (then say why), or the bound
            if not self._thread.is_alive():
                raise RuntimeError(f"delay proxy did not start: {self._error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"delay proxy did not start within {START_S:g} s")

    def __enter__(self) -> "DelayProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        """Zero ``responses`` and restart ``max_in_flight`` from the requests in flight now."""
        self.responses, self.max_in_flight = 0, self.in_flight

    def _run(self, start) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(start())
        except BaseException as e:  # reported by __init__
            self._error = e
            return
        self._loop.run_forever()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._handlers.add(asyncio.current_task())
        self._writers.add(client_w)
        waiting = False  # a request went up and its response has not started

        async def up(up_w: asyncio.StreamWriter) -> None:
            nonlocal waiting
            while data := await client_r.read(1 << 20):
                if not waiting:
                    waiting = True
                    self.in_flight += 1
                    self.max_in_flight = max(self.max_in_flight, self.in_flight)
                up_w.write(data)
                await up_w.drain()
            up_w.close()

        async def down(up_r: asyncio.StreamReader) -> None:
            nonlocal waiting
            while data := await up_r.read(1 << 20):
                if waiting:
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    waiting = False
                    self.in_flight -= 1
                    self.responses += 1
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
            self._writers.add(up_w)
            await asyncio.gather(up(up_w), down(up_r))
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass  # a closed connection (either side) or the proxy stopping: the handler simply ends
        finally:
            if waiting:
                self.in_flight -= 1
            for w in (client_w, locals().get("up_w")):
                if w is not None:
                    w.transport.abort()
                    self._writers.discard(w)
            self._handlers.discard(asyncio.current_task())

    def close(self) -> None:
        """Stop listening, close every connection (clients see a reset), end the handlers and the loop's thread."""
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            for t in list(self._handlers):  # also ends a response held in its delay; each handler swallows its
                t.cancel()                  # cancellation and returns (a cancelled one would make asyncio's
            if self._handlers:              # stream protocol log a traceback)
                await asyncio.wait(list(self._handlers), timeout=5)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()
