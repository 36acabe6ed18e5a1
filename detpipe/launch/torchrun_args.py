"""torchrun's arguments built from params, the same for a local run, the Slurm script of `detpipe.launch.slurm` and
the Kubernetes manifest of `detpipe.launch.k8s` (`torchrun_args`, `launch_env`), and their completion on each node
(`node_args`): whether this node hosts the c10d rendezvous store and the address its peers reach it at.

Every launch uses the c10d rendezvous (``--rdzv-backend c10d``): the agents of all nodes meet at
``train.rdzv_endpoint``, torchrun assigns node and global ranks, restarts the whole worker group up to
``train.max_restarts`` times when a worker or a node fails, and with ``train.nnodes: MIN:MAX`` goes on with as
few as MIN nodes (and admits returning ones at the next restart).

The node whose address the endpoint names hosts the rendezvous store. torch decides that by comparing the
endpoint's host with this machine's hostname, FQDN and the addresses the hostname resolves to
(``torch.distributed.elastic.rendezvous.utils._matches_machine_hostname``, which its docstring says may give a
false negative for addresses of secondary NICs): given an IP address the hostname does not resolve to (Debian maps
the hostname to 127.0.1.1; a second NIC), no node hosts it and every agent waits as a client until the join
timeout. Each node decides it itself (`node_args`: `is_endpoint_host`, the host is, or resolves to, one of this
machine's interface addresses) and says so in ``--rdzv-conf is_host=true|false``, with the address its peers
reach it at (``--local-addr``). This module imports no torch: the job description writers use it.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import socket

import psutil

from detpipe.core.errors import StageError
from detpipe.core.net import is_loopback
from detpipe.core.worker_env import COLLECTIVE_TIMEOUT_ENV

AGENT_MODULE = "detpipe.launch.torchrun"
"""What job scripts start on each node (Slurm's ``srun``, the Kubernetes pods): torchrun's agent completed on the
node, with this project's networking and lifetime fixes (`detpipe.launch.torchrun.main`)."""


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


def local_addresses() -> set[str]:
    """This machine's interface addresses (IPv4 and IPv6, zone ids such as ``%eth0`` dropped), from
    ``psutil.net_if_addrs``."""
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def is_endpoint_host(host: str) -> bool:
    """Whether this machine hosts a rendezvous at ``host``: a loopback name or address, this machine's hostname or
    FQDN, one of its interface addresses (`local_addresses`), or a name that resolves to one. A name that does
    not resolve counts as another machine's."""
    if is_loopback(host) or host in {socket.gethostname(), socket.getfqdn()}:
        return True
    try:
        resolved = {info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    return any(is_loopback(a) for a in resolved) or bool(resolved & local_addresses())


def default_run_id(cfg) -> str:
    """The rendezvous job id: ``train.rdzv_id``, else ``$SLURM_JOB_ID``, else ``detpipe-`` + 12 hex of the sha256
    of the params (`detpipe.launch.stage.LaunchParams.params_digest` when ``cfg`` has one; the same on every node that runs the same params, so a restarted node rejoins its job)."""
    if cfg.rdzv_id:
        return cfg.rdzv_id
    if os.environ.get("SLURM_JOB_ID"):
        return os.environ["SLURM_JOB_ID"]
    digest = getattr(cfg, "params_digest", "") or \
        hashlib.sha256(json.dumps(cfg.model_dump(), sort_keys=True).encode()).hexdigest()
    return "detpipe-" + digest[:12]


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
    conf = f"join_timeout={cfg.rdzv_join_timeout_s},last_call_timeout={cfg.rdzv_last_call_s}"
    args = ["--nnodes", str(lo) if lo == hi else f"{lo}:{hi}",
            "--nproc-per-node", str(nproc_per_node or cfg.nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", conf,
            "--max-restarts", str(cfg.max_restarts)]
    host = endpoint.rsplit(":", 1)[0]
    if is_loopback(host):
        args += ["--local-addr", host]
    return args + ["-m", module]


def launch_env(cfg) -> dict[str, str]:
    """Environment variables the launcher sets for the workers: ``OMP_NUM_THREADS`` (``train.threads`` or 1:
    what torchrun itself defaults to for more than one worker per node), ``PYTHONUNBUFFERED=1`` (log lines
    reach the job log as they happen), `COLLECTIVE_TIMEOUT_ENV` (``train.collective_timeout_s``, seconds) and, when
    ``train.socket_ifname`` is set, ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (the interface of the workers'
    traffic between nodes)."""
    env = {"OMP_NUM_THREADS": str(cfg.threads or 1), "PYTHONUNBUFFERED": "1",
           COLLECTIVE_TIMEOUT_ENV: f"{cfg.collective_timeout_s:g}"}
    if getattr(cfg, "socket_ifname", None):
        env.update({"GLOO_SOCKET_IFNAME": cfg.socket_ifname, "NCCL_SOCKET_IFNAME": cfg.socket_ifname})
    return env


def listens_on_endpoint_only(host: str) -> bool:
    """Whether a store hosted at ``host`` listens on that address alone (`agent_fixes`): a loopback address or
    name, or an IP address of this machine's (`local_addresses`). A host name gets torch's wildcard listener: the
    address it resolves to on this machine (e.g. Debian's 127.0.1.1) may not be the one other nodes reach."""
    if is_loopback(host):
        return True
    try:
        return str(ipaddress.ip_address(host)) in local_addresses()
    except ValueError:
        return False


def node_address(endpoint_host: str, ifname: str | None = None) -> str | None:
    """This machine's address as the other nodes of the job reach it: the first IPv4 (else IPv6) address of
    interface ``ifname`` (``train.socket_ifname``) when given, else the source address of this machine's route to
    ``endpoint_host`` (a UDP socket connected there: no packet is sent), else None (the host does not resolve,
    no route). Raises `StageError` when ``ifname`` is not an interface of this machine or has no address."""
    if ifname:
        addrs = psutil.net_if_addrs().get(ifname.split(",")[0])
        if addrs is None:
            raise StageError(f"params.yaml: train.socket_ifname {ifname!r}: no such interface here "
                             f"(interfaces: {', '.join(sorted(psutil.net_if_addrs()))})")
        for family in (socket.AF_INET, socket.AF_INET6):
            for a in addrs:
                if a.family == family:
                    return a.address.split("%")[0]
        raise StageError(f"params.yaml: train.socket_ifname {ifname!r}: the interface has no IP address")
    try:
        info = socket.getaddrinfo(endpoint_host, 9, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return s.getsockname()[0]
    except OSError:
        return None


def node_args(argv: list[str], ifname: str | None = None) -> list[str]:
    """torchrun arguments ``argv`` completed for this node (what the job description, written before the node
    is known, cannot say):

    * ``is_host=true|false`` in ``--rdzv-conf`` (added when missing), decided by `is_endpoint_host` for
      ``--rdzv-endpoint``'s host: torch's own hostname match misses an address the hostname does not resolve to;
    * ``--local-addr`` (when missing): `node_address` — the address the workers' bootstrap store, hosted by the
      agent that gets rank 0, is published and listens at. torch publishes ``socket.getfqdn()`` instead, which
      other nodes may not resolve (or resolve to 127.0.1.1) and then never reach.

    Raises `StageError` when there is no ``--rdzv-endpoint`` or ``ifname`` is unusable (`node_address`)."""
    argv = list(argv)
    if "--rdzv-endpoint" not in argv:
        raise StageError("torchrun arguments without --rdzv-endpoint HOST:PORT")
    at = argv.index("--rdzv-endpoint")
    host = argv[at + 1].rsplit(":", 1)[0]
    decision = f"is_host={str(is_endpoint_host(host)).lower()}"
    if "--rdzv-conf" not in argv:
        argv[at:at] = ["--rdzv-conf", decision]
    elif "is_host=" not in argv[argv.index("--rdzv-conf") + 1]:
        i = argv.index("--rdzv-conf") + 1
        argv[i] = f"{argv[i]},{decision}" if argv[i] else decision
    if "--local-addr" not in argv:
        address = host if is_loopback(host) else node_address(host, ifname)
        if address:
            argv[argv.index("--rdzv-endpoint"):argv.index("--rdzv-endpoint")] = ["--local-addr", address]
    return argv
