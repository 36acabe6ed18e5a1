"""Launching a stage's workers with torchrun's elastic agent, in this process: `launch_local` (a local launch),
`run_torchrun` (the agent) and `main` (``python -m detpipe.launch.torchrun``: one node's agent as a Slurm or
Kubernetes job starts it).

The arguments come from `detpipe.launch.torchrun_args` (built from params, completed for this node: which node
hosts the c10d rendezvous store, the address its peers reach it at); the agent runs with the fixes of
`detpipe.launch.agent_patches` (stores bound to their own address, restarted nodes able to rejoin); the workers
are forked from the agent or started as new interpreters (`detpipe.launch.worker_start`). Each restart is a fresh
start of the workers, which resume from the newest valid checkpoint (`stages.train`).
"""
from __future__ import annotations

import gc
import logging
import os
import shutil
import socket
import sys
import tempfile

from detpipe.core.errors import StageError
from detpipe.core.lifeline import LAUNCHER_PID_ENV
from detpipe.core.net import bind_listener, is_loopback
from detpipe.launch.agent_patches import agent_fixes
from detpipe.launch.torchrun_args import default_run_id, launch_env, node_args, parse_nnodes, torchrun_args
from detpipe.launch.worker_start import preload, prepare_fork, run_forked_worker, worker_start

log = logging.getLogger("detpipe.launch.torchrun")


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
                preload(args.training_script)
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
