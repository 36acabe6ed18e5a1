"""Launching a stage's workers with torchrun's elastic agent: the torchrun arguments built from params (the same
for a local run, the Slurm script of `detpipe.launch.slurm` and the Kubernetes manifest of `detpipe.launch.k8s`), and running
torchrun in this process.

Every launch uses the c10d rendezvous (``--rdzv-backend c10d``): the agents of all nodes meet at
``train.rdzv_endpoint``, torchrun assigns node and global ranks, restarts the whole worker group up to
``train.max_restarts`` times when a worker or a node fails, and with ``train.nnodes: MIN:MAX`` goes on with as
few as MIN nodes (and admits returning ones at the next restart). Each restart is a fresh start of the workers,
which resume from the newest valid checkpoint (`stages.train`).

The node whose address the endpoint names hosts the rendezvous store. torch decides that by comparing the
endpoint's host with this machine's hostname, FQDN and the addresses the hostname resolves to
(``torch.distributed.elastic.rendezvous.utils._matches_machine_hostname``, which its docstring says may give a
false negative for addresses of secondary NICs): given an IP address the hostname does not resolve to (Debian maps
the hostname to 127.0.1.1; a second NIC), no node hosts it and every agent waits as a client until the join
timeout. Each node decides it itself (`node_args`, in `launch_local` and in `main`, the agent the Slurm script
and the Kubernetes pods start: `is_endpoint_host`, the host is, or resolves to, one of this machine's interface
addresses) and says so in ``--rdzv-conf is_host=true|false``, with the address its peers reach it at
(``--local-addr``).

One node: the rendezvous uses a free port on 127.0.0.1 and both TCP stores torchrun's agent hosts (the c10d
rendezvous store and the store the workers bootstrap from) listen on 127.0.0.1 only — plain ``torchrun
--standalone`` listens on all interfaces (torch's ``TCPStore`` server binds the wildcard address whatever the
host; we hand it a socket bound to the loopback address through its ``master_listen_fd`` argument).
"""
from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from typing import Iterator

import psutil

from detpipe.core.errors import StageError
from detpipe.core.net import bind_listener  # noqa: F401  (the agent's store sockets; public here for the tests)
from detpipe.core.lifeline import LAUNCHER_PID_ENV, PR_SET_NAME, die_with_launcher, prctl
from detpipe.core.worker_env import COLLECTIVE_TIMEOUT_ENV

log = logging.getLogger("detpipe.launch.torchrun")

AGENT_MODULE = "detpipe.launch.torchrun"
"""What job scripts start on each node (Slurm's ``srun``, the Kubernetes pods): torchrun's agent completed on the
node, with this project's networking and lifetime fixes (`main`)."""


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


WORKER_START_ENV = "DETPIPE_WORKER_START"
"""How the elastic agent starts its workers: ``fork`` (the default on Linux) or ``exec``.

``exec`` is plain torchrun: each worker is a new interpreter, ``python -u -m <module>``, which imports torch,
torchvision and the stage's code again (about 4.5 s of CPU per worker on this project's 2-core CI machine,
`benchmarks.worker_start`). ``fork``: the agent imports the worker module's ``WORKER_PRELOAD`` modules once
(``stages.train``: the trainer), then forks each worker from itself (torch's own function-entrypoint path,
``LaunchConfig.start_method="fork"``), and the worker runs the module as ``python -m`` would
(`run_forked_worker`). The agent must not have initialised CUDA or started an OpenMP thread team (neither survives
a fork): it keeps torch to one intra-op thread until it forks (`prepare_fork`), and falls back to ``exec`` when
CUDA is initialised. Other values are an error."""

WORKER_PRELOAD = "WORKER_PRELOAD"
"""The name of the tuple of module names a worker module (``stages.train``) asks the agent to import before it
forks the workers (`WORKER_START_ENV`)."""


def worker_start() -> str:
    """``fork`` or ``exec`` per `WORKER_START_ENV` (default ``fork``; ``exec`` outside Linux and once this process
    has initialised CUDA). Raises `StageError` on another value."""
    choice = os.environ.get(WORKER_START_ENV, "fork")
    if choice not in ("fork", "exec"):
        raise StageError(f"${WORKER_START_ENV}={choice!r}: expected fork or exec")
    if choice == "fork" and not sys.platform.startswith("linux"):
        return "exec"
    if choice == "fork" and "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        log.info("CUDA is initialised in the agent: starting the workers with exec instead of fork")
        return "exec"
    return choice


def prepare_fork() -> None:
    """Make this process safe to fork workers from, before it runs anything in torch: one intra-op thread (no
    OpenMP thread team to inherit: GNU OpenMP's does not survive a fork; the worker sets its own count,
    `run_forked_worker`). `run_torchrun` calls it; a launcher that runs torch before (``python -m stages.train``
    checks the checkpoint to resume) calls it first thing."""
    import torch

    torch.set_num_threads(1)


def worker_name(module: str, local_rank: int | str) -> str:
    """The process name (``/proc/PID/comm``, what ``ps``, ``top`` and ``psutil.Process.name`` show; 15 bytes at most)
    of a forked worker: ``<stage>-r<local rank>``, e.g. ``train-r0`` for ``stages.train``."""
    return f"{module.rpartition('.')[2][:10]}-r{local_rank}"[:15]


def worker_local_rank(process) -> int | None:
    """The local rank of a torchrun worker (a `psutil.Process`): ``LOCAL_RANK`` in its environment (an ``exec``
    worker) or its `worker_name` (a forked one); None for any other process. `psutil.Error` propagates."""
    env_rank = process.environ().get("LOCAL_RANK")
    if env_rank is not None:
        return int(env_rank)
    stem, _, rank = process.name().rpartition("-r")
    return int(rank) if stem and rank.isdigit() and process.name() == worker_name(stem, rank) else None


def run_forked_worker(module: str, *script_args: str) -> None:
    """A forked worker's entry point (in the worker process; `WORKER_START_ENV`): start as a new interpreter
    would and run ``module`` as ``python -u -m module *script_args`` does.

    First it names itself (`worker_name`: what ``ps`` shows), takes a session of its own as torchrun's ``exec``
    workers have (a signal to the launcher's process group, a terminal's Ctrl-C, does not reach the workers: the
    agent stops them) and binds itself to the launcher's life (`detpipe.core.lifeline.die_with_launcher`). Then the
    agent's state that a new interpreter would not have is reset: its signal handlers and wakeup fd (torchrun's
    agent turns SIGTERM into an exception), its ``atexit`` functions (the worker runs its own at the end: a forked
    process leaves through ``os._exit``), stdout/stderr line-buffered (the agent sets ``PYTHONUNBUFFERED`` for
    ``exec`` workers), torch's intra-op threads from ``OMP_NUM_THREADS`` as torch reads it at import, ``sys.argv``.
    An exception other than `SystemExit` prints its traceback, as an interpreter does, before it propagates
    (torch's multiprocessing wrapper only queues it)."""
    import atexit
    import runpy
    import signal
    import traceback

    import torch

    set_process_name(worker_name(module, os.environ.get("LOCAL_RANK", "0")))  # first: what `ps` shows
    os.setsid()
    die_with_launcher()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    atexit._clear()
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else (os.cpu_count() or 1))
    sys.argv = [module, *script_args]
    sys.modules.pop(module, None)  # imported by the agent for its WORKER_PRELOAD: run it afresh, as ``-m`` does
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        atexit._run_exitfuncs()


def set_process_name(name: str) -> None:
    """Set this process's name (``prctl(PR_SET_NAME)``, `detpipe.core.lifeline.prctl`; cut to 15 bytes); nothing outside
    Linux."""
    prctl(PR_SET_NAME, name.encode()[:15])


def _preload(module: str) -> None:
    import importlib

    for name in getattr(importlib.import_module(module), WORKER_PRELOAD, ()):
        importlib.import_module(name)


def run_torchrun(argv: list[str], env: dict[str, str] | None = None,
                 ready: dict[int, socket.socket] | None = None) -> None:
    """Run ``torchrun <argv>`` in this process (the elastic agent), with ``env`` added to the environment the
    workers inherit, and ``$DETPIPE_LAUNCHER_PID`` (`detpipe.core.lifeline.LAUNCHER_PID_ENV`) set to this process's
    pid: the workers' parent, whose death kills them (`detpipe.core.lifeline.die_with_launcher`); loopback stores
    bound to 127.0.0.1 only and restarted nodes able to rejoin (`agent_fixes`). The workers are forked from this
    process or started as new interpreters (`WORKER_START_ENV`; ``argv`` must end in ``-m <module> [args]``
    for ``fork``). A failed job becomes a one-line `StageError` naming the first failed rank and its exit code
    (the worker's own message is printed above it) instead of torchrun's traceback. Without ``--log-dir`` in
    ``argv``, torchelastic's per-run folder (workers' ``error.json`` files) is a temporary folder removed when
    the launch ends, not a ``/tmp/torchelastic_*`` left behind by every training.

    Raises:
        StageError: the worker group failed more than ``--max-restarts`` times, or the rendezvous failed.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    start = worker_start()
    if start == "fork":
        prepare_fork()
    os.environ.update({**(env or {}), LAUNCHER_PID_ENV: str(os.getpid())})  # the workers' parent: this process
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    log.info("launching: torchrun %s (workers started by %s)", " ".join(argv), start)
    args = parse_args(argv)
    if args.master_port is None:  # as torch.distributed.run.run (unused by the c10d rendezvous)
        args.master_port = 29500
    own_log_dir = args.log_dir is None
    if own_log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="detpipe-torchelastic-")
    try:
        with agent_fixes(ready):
            config, cmd, cmd_args = config_from_args(args)
            if start == "fork" and args.module:
                _preload(args.training_script)
                gc.freeze()     # the imports: never traversed again by a collection, here or in a forked worker
                config.start_method = "fork"
                elastic_launch(config=config, entrypoint=run_forked_worker)(args.training_script,
                                                                            *args.training_script_args)
            else:
                elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        rank, failure = next(iter(e.failures.items()))
        raise StageError(f"{args.training_script} failed: rank {rank} exited with code {failure.exitcode} "
                         f"(see its message above)") from None
    except RendezvousError as e:
        raise StageError(f"{args.training_script}: rendezvous at {args.rdzv_endpoint} failed: "
                         f"{type(e).__name__}: {e}") from None
    finally:
        if own_log_dir:
            shutil.rmtree(args.log_dir, ignore_errors=True)


def launch_local(cfg, module: str, nproc_per_node: int | None = None) -> None:
    """Launch ``python -m <module>`` workers on this node per ``cfg`` (`detpipe.launch.stage.LaunchParams`: nnodes,
    rdzv settings, max_restarts, threads). One node (``nnodes`` 1): a free port on 127.0.0.1, bound before
    torchrun starts. More nodes: ``cfg.rdzv_endpoint``; start the same command, with the same params, on every
    node (or use `detpipe.launch.slurm` / `detpipe.launch.k8s`). With a loopback endpoint the workers' gloo and NCCL sockets
    use the loopback interface as well (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` = ``lo``, Linux). Whether
    this node hosts the rendezvous store, and the address it is reached at, are decided here (`node_args`)."""
    ready, env = {}, launch_env(cfg)
    if parse_nnodes(cfg.nnodes)[1] == 1:
        sock = bind_listener("127.0.0.1", 0)
        ready[sock.getsockname()[1]] = sock
        endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
    else:
        endpoint = cfg.rdzv_endpoint
    host = endpoint.rsplit(":", 1)[0]
    if is_loopback(host) and sys.platform.startswith("linux"):
        # the workers' own gloo / NCCL sockets on the loopback interface too (unless the user chose one)
        env.update({k: "lo" for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in os.environ and k not in env})
    argv = node_args(torchrun_args(cfg, module, endpoint, default_run_id(cfg), nproc_per_node), cfg.socket_ifname)
    run_torchrun(argv, env, ready)



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


def main(argv: list[str] | None = None) -> None:
    """``python -m detpipe.launch.torchrun <torchrun arguments>``: one node's torchrun agent as a job script starts
    it (the Slurm script's ``srun``): torchrun itself, plus what `launch_local` gives a local launch: the
    arguments completed for this node (`node_args`, with ``$GLOO_SOCKET_IFNAME``, which the script exports from
    ``train.socket_ifname``), a store at an IP address listening on that address only, restarted nodes able to
    rejoin (`agent_fixes`), the workers bound to this process's life, and a failed job as one ``error: ...``
    line with exit status 2 (`detpipe.core.errors.run_program`)."""
    from detpipe.core.errors import run_program

    raw = sys.argv[1:] if argv is None else argv
    run_program(lambda: run_torchrun(node_args(raw, os.environ.get("GLOO_SOCKET_IFNAME"))), stage="train")


if __name__ == "__main__":
    main()
