"""`detpipe.core.net.bind_listener`: the one server-socket helper (torchrun's store, the model server)."""
from __future__ import annotations

import socket

import pytest

from detpipe.core.errors import StageError
from detpipe.core.net import bind_listener


def test_listener_binds_listens_and_refuses_a_taken_port():
    server = bind_listener("127.0.0.1", 0)
    try:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass                                  # listening: a client connects
        with pytest.raises(OSError):
            bind_listener("127.0.0.1", port)      # a socket listens there
    finally:
        server.close()


def test_bound_only_for_a_server_that_listens_itself_and_serve_names_the_address():
    from detpipe.serve import listen_socket

    sock = bind_listener("127.0.0.1", 0, backlog=None)
    try:
        port = sock.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        sock.listen(1)
        with pytest.raises(StageError, match=rf"^127\.0\.0\.1:{port}: cannot listen there"):
            listen_socket("127.0.0.1", port)
    finally:
        sock.close()
