"""The one way this project opens a server socket: `bind_listener` (torchrun's rendezvous store, the model server);
`is_loopback`, the one test of a loopback host."""
from __future__ import annotations

import ipaddress
import socket


def bind_listener(host: str = "127.0.0.1", port: int = 0, backlog: int | None = 4096) -> socket.socket:
    """A TCP socket bound to ``host:port`` (an IP address or ``localhost``; IPv6 when ``host`` has a ``:``; port 0:
    a free one), listening with ``backlog`` (None: bound only, its server calls ``listen``, as uvicorn does).

    ``SO_REUSEADDR``, as torch's own store server sets it: without it, a node that hosted the store and starts again
    within TCP's TIME_WAIT (60 s on Linux; Slurm requeues the job onto the same first node) cannot bind the port,
    takes it for another agent's store, joins it as a client and waits for nobody until the rendezvous times out;
    a restarted server could not take its port back either.

    Raises:
        OSError: the address cannot be bound (a socket listens there, not a local address, no permission); the
            socket is closed.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if backlog is not None:
            sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback IP address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
