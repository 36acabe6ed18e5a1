"""How torchrun's agent starts the workers: forked from the agent after it imported the worker module's heavy
imports once (the default on Linux), or as new interpreters (plain torchrun); what a forked worker resets to start
as a new interpreter would (`run_forked_worker`), and how the workers are told apart in ``ps`` (`worker_name`).
"""
from __future__ import annotations

import logging
import os
import sys

from detpipe.core.errors import StageError
from detpipe.core.lifeline import PR_SET_NAME, die_with_launcher, prctl

log = logging.getLogger("detpipe.launch.torchrun")


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


def preload(module: str) -> None:
    """Import the modules ``module`` names in its `WORKER_PRELOAD` tuple (in the agent, before it forks)."""
    import importlib

    for name in getattr(importlib.import_module(module), WORKER_PRELOAD, ()):
        importlib.import_module(name)
