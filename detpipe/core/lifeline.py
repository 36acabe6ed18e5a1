"""Tie a process's life to its parent's (Linux ``prctl(PR_SET_PDEATHSIG)``), race-free. Standard library only,
so a process binds itself first thing, before heavy imports. The one ``prctl`` binding of detpipe (`prctl`; also
used by `detpipe.orchestration.processes`'s guard).

Users: a torchrun worker of a stage (`die_with_launcher`, called first thing by a forked worker,
`detpipe.launch.worker_start.run_forked_worker`, and by ``python -m stages.train`` before it imports torch), so a
``kill -9`` of the stage never leaves orphan workers writing checkpoints beside a rerun; the flow-run process
started by serve or a Prefect worker (``flows/train.py``, see `detpipe.orchestration.processes`); a forked worker naming
itself (`PR_SET_NAME`).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

# Set by the launcher (`detpipe.launch.torchrun.run_torchrun`, the elastic agent in the launcher's own process) for its
# workers: the pid of their parent, so a worker that starts after its launcher died notices.
LAUNCHER_PID_ENV = "DETPIPE_LAUNCHER_PID"
PR_SET_PDEATHSIG, PR_SET_NAME, PR_SET_CHILD_SUBREAPER = 1, 15, 36  # <linux/prctl.h>


def prctl(option: int, value: int | bytes) -> None:
    """Linux ``prctl(option, value, 0, 0, 0)`` through libc (e.g. `PR_SET_PDEATHSIG` with a signal number,
    `PR_SET_CHILD_SUBREAPER` with 1, `PR_SET_NAME` with a name of at most 15 bytes, passed as a ``char *``); nothing
    on other systems. The call's status is not checked."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (``PR_SET_PDEATHSIG``; no kernel
    binding outside Linux). The parent is checked after the signal is set: if it is already gone (the parent
    pid is not ``expected_parent`` when given, changed since before the call, or is 1), ``sig`` is sent now.

    ``expected_parent`` closes the window between this process's start and the call: a parent that died
    then is no longer this process's parent (it was reparented to init or a subreaper), which a parent pid
    read only here cannot tell."""
    before = os.getppid()
    prctl(PR_SET_PDEATHSIG, int(sig))
    now = os.getppid()
    if now != before or now == 1 or (expected_parent is not None and now != expected_parent):
        os.kill(os.getpid(), sig)


def die_with_launcher() -> None:
    """For a torchrun worker, first thing: SIGKILL this process when its launcher dies, now if it already has.
    The launcher is ``$DETPIPE_LAUNCHER_PID`` where `detpipe.launch.torchrun.run_torchrun` set it, else the parent as it
    is now (plain ``torchrun``, as in the Slurm and Kubernetes jobs)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(signal.SIGKILL, int(launcher) if launcher else None)
