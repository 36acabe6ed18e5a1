"""Patches of torch's elastic agent internals, active only while `detpipe.launch.torchrun.run_torchrun` runs the
agent in this process (`agent_fixes`): store servers bound to their own address, and the workers' bootstrap store
published in every rendezvous round.

One node: the rendezvous uses a free port on 127.0.0.1 and both TCP stores torchrun's agent hosts (the c10d
rendezvous store and the store the workers bootstrap from) listen on 127.0.0.1 only — plain ``torchrun
--standalone`` listens on all interfaces (torch's ``TCPStore`` server binds the wildcard address whatever the
host; we hand it a socket bound to the loopback address through its ``master_listen_fd`` argument).
"""
from __future__ import annotations

import contextlib
import errno
import socket
from typing import Iterator

from detpipe.core.net import bind_listener
from detpipe.launch.torchrun_args import listens_on_endpoint_only


def _address_in_use(e: BaseException) -> bool:
    """Whether a bind failed because the port is taken: `OSError` EADDRINUSE, or torch's ``DistNetworkError``
    saying ``EADDRINUSE``."""
    return getattr(e, "errno", None) == errno.EADDRINUSE or "EADDRINUSE" in str(e)


@contextlib.contextmanager
def agent_fixes(ready: dict[int, socket.socket] | None = None) -> Iterator[None]:
    """Fixes to torchrun's agent (this process), while active:

    * every ``TCPStore`` server it creates on a loopback address or on an IP address of this machine
      (`listens_on_endpoint_only`) listens on that address only: it gets a socket bound there
      (``TCPStore(master_listen_fd=...)``), taken from ``ready`` (``{port: socket}``, bound ahead so the port
      cannot be taken meanwhile) or bound now. Servers at a host name are left to torch (wildcard); one that
      cannot listen because the port is taken (another agent on
      this machine hosts the store: ``is_host=true`` on both) connects to it as a client, as torch itself does
      when it guessed the host (``c10d_rendezvous_backend._create_tcp_store``);
    * the workers' bootstrap store address is published in every rendezvous round, so that a node that was
      killed and started again can join the restarted job (torch publishes it only in an agent's first round).
    """
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    real_store = dist.TCPStore
    ready = dict(ready or {})

    def store(host_name, port, *args, is_master=False, **kwargs):
        if is_master and kwargs.get("master_listen_fd") is None:
            try:
                if not listens_on_endpoint_only(host_name):
                    return real_store(host_name, port, *args, is_master=True, **kwargs)
                sock = ready.pop(port, None) or bind_listener(host_name, port)
            except (OSError, RuntimeError) as e:
                if not _address_in_use(e):
                    raise
                is_master = False  # another agent on this machine hosts it (is_host=true on both): join it
            else:
                bound = sock.getsockname()[1]
                return real_store(host_name, bound, *args, is_master=True, master_listen_fd=sock.detach(), **kwargs)
        return real_store(host_name, port, *args, is_master=is_master, **kwargs)

    def shared_server(self, master_addr, master_port):  # same arguments as torch's own method
        return store(master_addr, master_port, is_master=True, multi_tenant=True)

    real_next = DynamicRendezvousHandler.next_rendezvous

    def next_rendezvous(self):
        # torch shares the agent's store with the workers but publishes its address (MASTER_ADDR/PORT, under the
        # round's key prefix) only in an agent's first round: a node that joins a later round (a restarted node)
        # waits for it until the store times out. Publishing it in every round lets restarted nodes rejoin.
        self._bootstrap_store_info = None
        return real_next(self)

    saved = (c10d_backend.TCPStore, DynamicRendezvousHandler._create_tcp_store_server, real_next)
    (c10d_backend.TCPStore, DynamicRendezvousHandler._create_tcp_store_server,
     DynamicRendezvousHandler.next_rendezvous) = store, shared_server, next_rendezvous
    try:
        yield
    finally:
        (c10d_backend.TCPStore, DynamicRendezvousHandler._create_tcp_store_server,
         DynamicRendezvousHandler.next_rendezvous) = saved
        for sock in ready.values():
            sock.close()
