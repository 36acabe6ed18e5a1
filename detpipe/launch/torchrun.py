"""Launching a stage's workers with torchrun's elastic agent: the torchrun arguments built from params (the same
for a local run, the Slurm script of `detpipe.launch.slurm` and the Kubernetes manifest of `detpipe.launch.k8s`), and running
torchrun in this process.

Every launch uses the c10d rendezvous (``--rdzv-backend c10d``): the agents of all nodes meet at
``train.rdzv_endpoint``, torchrun assigns node and global ranks, restarts the whole worker group up to
``train.max_restarts`` times when a worker or a node fails, and with ``train.nnodes: MIN:MAX`` goes on with as
few as MIN nodes (and admits returning ones at the next restart). Each restart is a fresh start of the workers,
which resume from the newest valid checkpoint (`stages.train`).

One node: the rendezvous uses a free port on 127.0.0.1 and both TCP stores torchrun's agent hosts (the c10d
rendezvous store and the store the workers bootstrap from) listen on 127.0.0.1 only — plain ``torchrun
--standalone`` listens on all interfaces (torch's ``TCPStore`` server binds the wildcard address whatever the
host; we hand it a socket bound to the loopback address through its ``master_listen_fd`` argument).
"""
from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import socket
import sys
from typing import Iterator

from detpipe.errors import StageError
from detpipe.lifeline import LAUNCHER_PID_ENV

log = logging.getLogger("detpipe.launch.torchrun")

# Train params that only say how the job is launched: they change neither what is trained nor its result.
LAUNCH_ONLY = frozenset({"nnodes", "rdzv_endpoint", "max_restarts", "rdzv_id", "rdzv_join_timeout_s",
                         "rdzv_last_call_s", "launcher", "slurm_partition", "slurm_time", "slurm_tasks_per_node",
                         "slurm_cpus_per_task", "slurm_extra", "k8s_image"})


def parse_nnodes(spec: str) -> tuple[int, int]:
    """``"N"`` -> ``(N, N)``; ``"MIN:MAX"`` -> ``(MIN, MAX)``. Raises `StageError` on anything else."""
    lo, _, hi = str(spec).partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise StageError(f"params.yaml: train.nnodes {spec!r}: expected N or MIN:MAX") from None
    if not 1 <= lo_n <= hi_n:
        raise StageError(f"params.yaml: train.nnodes {spec!r}: need 1 <= MIN <= MAX")
    return lo_n, hi_n


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback IP address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_run_id(cfg) -> str:
    """The rendezvous job id: ``train.rdzv_id``, else ``$SLURM_JOB_ID``, else ``detpipe-`` + 12 hex of the sha256
    of the params (the same on every node that runs the same params, so a restarted node rejoins its job)."""
    if cfg.rdzv_id:
        return cfg.rdzv_id
    if os.environ.get("SLURM_JOB_ID"):
        return os.environ["SLURM_JOB_ID"]
    return "detpipe-" + hashlib.sha256(json.dumps(cfg.model_dump(), sort_keys=True).encode()).hexdigest()[:12]


def torchrun_args(cfg, module: str, endpoint: str, run_id: str, nproc_per_node: int | None = None) -> list[str]:
    """torchrun's arguments for ``python -m <module>`` under params ``cfg`` (`detpipe.params.Train`).

    Args:
        endpoint: ``host:port`` of the c10d rendezvous store (hosted by the agent on that host).
        run_id: rendezvous job id, the same for every agent of the job.
        nproc_per_node: workers per agent (default ``cfg.nproc_per_node``).
    Returns:
        e.g. ``["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
        "10.0.0.5:29400", "--rdzv-id", "4711", "--rdzv-conf", "join_timeout=600,last_call_timeout=30",
        "--max-restarts", "3", "-m", "stages.train"]``; ``--local-addr 127.0.0.1`` is added when the endpoint
        is a loopback address (the workers then reach their bootstrap store on 127.0.0.1 as well).
    """
    lo, hi = parse_nnodes(cfg.nnodes)
    args = ["--nnodes", str(lo) if lo == hi else f"{lo}:{hi}",
            "--nproc-per-node", str(nproc_per_node or cfg.nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", f"join_timeout={cfg.rdzv_join_timeout_s},last_call_timeout={cfg.rdzv_last_call_s}",
            "--max-restarts", str(cfg.max_restarts)]
    host = endpoint.rsplit(":", 1)[0]
    if is_loopback(host):
        args += ["--local-addr", host]
    return args + ["-m", module]


def launch_env(cfg) -> dict[str, str]:
    """Environment variables the launcher sets for the workers: ``OMP_NUM_THREADS`` (``train.threads`` or 1:
    what torchrun itself defaults to for more than one worker per node) and ``PYTHONUNBUFFERED=1`` (log lines
    reach the job log as they happen)."""
    return {"OMP_NUM_THREADS": str(cfg.threads or 1), "PYTHONUNBUFFERED": "1"}


def bind_loopback(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one). Raises `OSError` if the port is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(4096)
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def agent_fixes(ready: dict[int, socket.socket] | None = None) -> Iterator[None]:
    """Two fixes to torchrun's agent (this process), while active:

    * every ``TCPStore`` server it creates on a loopback address listens on that address only: it gets a socket
      bound there (``TCPStore(master_listen_fd=...)``), taken from ``ready`` (``{port: socket}``, bound ahead so
      the port cannot be taken meanwhile) or bound now. Servers on other addresses are left to torch (they must
      be reachable from the other nodes);
    * the workers' bootstrap store address is published in every rendezvous round, so that a node that was
      killed and started again can join the restarted job (torch publishes it only in an agent's first round).
    """
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    real_store = dist.TCPStore
    ready = dict(ready or {})

    def store(host_name, port, *args, is_master=False, **kwargs):
        if not is_master or not is_loopback(host_name) or kwargs.get("master_listen_fd") is not None:
            return real_store(host_name, port, *args, is_master=is_master, **kwargs)
        try:
            sock = ready.pop(port, None) or bind_loopback(host_name, port)
        except OSError as e:  # another agent on this host serves it: torch then connects as a client
            raise RuntimeError(f"{host_name}:{port}: {e}") from e
        bound = sock.getsockname()[1]
        return real_store(host_name, bound, *args, is_master=True, master_listen_fd=sock.detach(), **kwargs)

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


def run_torchrun(argv: list[str], env: dict[str, str] | None = None,
                 ready: dict[int, socket.socket] | None = None) -> None:
    """Run ``torchrun <argv>`` in this process (the elastic agent), with ``env`` added to the environment the
    workers inherit, and ``$DETPIPE_LAUNCHER_PID`` (`detpipe.lifeline.LAUNCHER_PID_ENV`) set to this process's
    pid: the workers' parent, whose death kills them (`detpipe.lifeline.die_with_launcher`); loopback stores
    bound to 127.0.0.1 only and restarted nodes able to rejoin (`agent_fixes`). A failed job becomes a one-line
    `StageError` naming the first failed rank and its exit code (the worker's own message is printed above it)
    instead of torchrun's traceback.

    Raises:
        StageError: the worker group failed more than ``--max-restarts`` times, or the rendezvous failed.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    os.environ.update({**(env or {}), LAUNCHER_PID_ENV: str(os.getpid())})  # the workers' parent: this process
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    log.info("launching: torchrun %s", " ".join(argv))
    try:
        with agent_fixes(ready):
            run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = next(iter(e.failures.items()))
        raise StageError(f"{argv[-1]} failed: rank {rank} exited with code {failure.exitcode} "
                         f"(see its message above)") from None
    except RendezvousError as e:
        raise StageError(f"{argv[-1]}: rendezvous at {argv[argv.index('--rdzv-endpoint') + 1]} failed: "
                         f"{type(e).__name__}: {e}") from None


def launch_local(cfg, module: str, nproc_per_node: int | None = None) -> None:
    """Launch ``python -m <module>`` workers on this node per ``cfg`` (`detpipe.params.Train`-like: nnodes,
    rdzv settings, max_restarts, threads). One node (``nnodes`` 1): a free port on 127.0.0.1, bound before
    torchrun starts. More nodes: ``cfg.rdzv_endpoint``; start the same command, with the same params, on every
    node (or use `detpipe.launch.slurm` / `detpipe.launch.k8s`). With a loopback endpoint the workers' gloo and NCCL sockets
    use the loopback interface as well (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` = ``lo``, Linux)."""
    ready, env = {}, launch_env(cfg)
    if parse_nnodes(cfg.nnodes)[1] == 1:
        sock = bind_loopback("127.0.0.1", 0)
        ready[sock.getsockname()[1]] = sock
        endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
    else:
        endpoint = cfg.rdzv_endpoint
    if is_loopback(endpoint.rsplit(":", 1)[0]) and sys.platform.startswith("linux"):
        # the workers' own gloo / NCCL sockets on the loopback interface too (unless the user chose one)
        env.update({k: "lo" for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in os.environ})
    run_torchrun(torchrun_args(cfg, module, endpoint, default_run_id(cfg), nproc_per_node), env, ready)
