"""A ``kill -9`` of the train stage's process group leaves no torchrun worker behind, whenever it comes.

torchrun starts each worker in a session of its own, so a killed group (``dvc repro``'s, a terminal's) does not
reach the workers: only their binding to the launcher (`detpipe.core.lifeline.die_with_launcher`) ends them. Each case
starts ``python -m stages.train`` as a group leader (as ``dvc repro`` would be), SIGKILLs the group at one moment
of the workers' start-up, and asserts that within a few seconds no process of the run is left and that nothing is
written into ``checkpoints/`` or ``models/`` after the kill. A fast test shows the race those kills may hit, made
certain: a worker whose launcher died before it bound itself, under a subreaper (its parent pid is then not 1).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from detpipe.launch.worker_start import WORKER_START_ENV, worker_local_rank
from support.pipeline import checkpoints, write_params
from support.procs import stage_env

# Long enough that a surviving worker would still be training (and writing checkpoints) when the test looks.
TRAIN = {"epochs": 20, "batch_size": 2, "checkpoint_every": 1, "keep_last": 50, "threads": 1, "warmup_iters": 1}
DIE_S = 10.0    # how long the workers may take to die after the kill
QUIET_S = 3.0   # then how long checkpoints/ and models/ must stay as they were


def _workers(launcher: psutil.Process, known: dict[int, psutil.Process]) -> dict[int, psutil.Process]:
    """``known`` plus the launcher's children that are torchrun workers by now
    (`detpipe.launch.worker_start.worker_local_rank`: a forked worker once it has named itself, an exec'd one once it
    has exec'd ``python -m stages.train``)."""
    for child in launcher.children():
        try:
            if child.pid not in known and worker_local_rank(child) is not None:
                known[child.pid] = child
        except psutil.Error:
            continue
    return known


def _importing_torch(workers: dict[int, psutil.Process]) -> bool:
    """Whether a worker has mapped libtorch: its ``import torch`` (seconds long) is under way."""
    for pid in workers:
        try:
            if "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text():
                return True
        except OSError:
            continue
    return False


MOMENTS = {  # when to kill: a predicate of (workdir, workers found so far)
    "started": lambda work, workers: bool(workers),                # forked and named, or exec'd, before its imports
    "importing": lambda work, workers: _importing_torch(workers),  # mid-import (torch; an exec'd worker)
    "training": lambda work, workers: bool(checkpoints(work)),    # after its imports: first checkpoint written
}


def _left(work: Path) -> list[psutil.Process]:
    """Processes of this run still alive: ``stages.train`` running in ``work`` (launcher or worker)."""
    left = []
    for p in psutil.process_iter(["cmdline", "cwd", "ppid", "status"]):
        if p.info["cwd"] == str(work) and "stages.train" in (p.info["cmdline"] or []) and \
                p.info["status"] != psutil.STATUS_ZOMBIE:
            left.append(p)
    return left


def _snapshot(work: Path) -> dict[str, tuple[int, int]]:
    """``{path: (size, mtime_ns)}`` of everything under ``checkpoints/`` and ``models/``."""
    files = {}
    for f in sorted(work.glob("checkpoints/**/*")) + sorted(work.glob("models/**/*")):
        try:
            files[str(f.relative_to(work))] = (f.stat().st_size, f.stat().st_mtime_ns)
        except FileNotFoundError:  # renamed meanwhile (a checkpoint's temporary file)
            continue
    return files


@pytest.mark.slow
@pytest.mark.parametrize("moment, nproc, start", [("started", 2, "fork"), ("importing", 1, "exec"),
                                                  ("training", 2, "fork")])
def test_kill9_of_stage_group_leaves_no_worker(cached_workdir, tmp_path, moment, nproc, start):
    """SIGKILL of the stage's process group at ``moment`` of its ``nproc`` workers' start-up, the workers started
    by ``start`` (`detpipe.launch.worker_start.WORKER_START_ENV`; only an exec'd worker imports torch after it starts):
    every worker is gone within `DIE_S` seconds and ``checkpoints/`` and ``models/`` stay as they were at the
    kill."""
    work = Path(os.path.realpath(tmp_path / "work"))
    shutil.copytree(cached_workdir / "data", work / "data")
    write_params(work, {"train": {**TRAIN, "nproc_per_node": nproc}})
    with open(tmp_path / "stage.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=work,
                                env={**stage_env(), WORKER_START_ENV: start}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    launcher, workers = psutil.Process(proc.pid), {}
    try:
        deadline = time.monotonic() + 300
        while not MOMENTS[moment](work, _workers(launcher, workers)):
            assert proc.poll() is None, f"the stage ended early:\n{(tmp_path / 'stage.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no moment {moment!r} within 300 s"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed_at, before = time.monotonic(), _snapshot(work)
        assert workers and len(workers) <= nproc and (moment == "training" or not before)
        while (left := _left(work)) and time.monotonic() < killed_at + DIE_S:
            time.sleep(0.1)
        died_s = time.monotonic() - killed_at
        time.sleep(QUIET_S)
        after = _snapshot(work)
        written = sorted(f for f in after if after[f] != before.get(f))
        assert not left and not written, (
            f"{len(left)} process(es) of the run outlived the kill by {died_s:.0f} s: "
            + "; ".join(f"pid {p.pid} ppid {p.info['ppid']} {' '.join(p.info['cmdline'])}" for p in left)
            + f"; {len(written)} file(s) written after the kill: {', '.join(written[:4])}"
            + " ..." * (len(written) > 4))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in _left(work):
            with contextlib.suppress(psutil.Error):
                p.kill()


# A child subreaper (as `detpipe.orchestration.processes.guard` is: an orphan's parent pid is then not 1) forks a launcher, which
# starts one worker as torchrun does (own session, ``LOCAL_RANK`` and ``$DETPIPE_LAUNCHER_PID`` set) and exits
# before or after the worker binds itself (argv[1]: "before" / "after"). The worker, reparented to the subreaper,
# is reaped there, which prints its exit status (-9: SIGKILL), or "alive" if it still runs 10 s later.
_WORKER = """
import os, sys, time
mode, out = sys.argv[1:3]
while mode == "before" and os.getppid() == int(os.environ["DETPIPE_LAUNCHER_PID"]):
    time.sleep(0.01)  # bind only once the launcher has died
from detpipe.core.lifeline import die_with_launcher
die_with_launcher()
open(out, "a").write("bound")
time.sleep(60)
"""
_TREE = """
import ctypes, os, subprocess, sys, time
import psutil
worker, mode, out = sys.argv[1:4]
ctypes.CDLL("libc.so.6").prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
if os.fork() == 0:  # the launcher
    env = {**os.environ, "LOCAL_RANK": "0", "DETPIPE_LAUNCHER_PID": str(os.getpid())}
    subprocess.Popen([sys.executable, "-c", worker, mode, out], env=env, start_new_session=True)
    started = time.monotonic()
    while mode == "after" and "bound" not in open(out).read() and time.monotonic() < started + 10:
        time.sleep(0.01)
    os._exit(0)
os.wait()  # the launcher
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid:
        sys.exit(print(os.waitstatus_to_exitcode(status)))
    time.sleep(0.02)
for p in psutil.Process().children():
    p.kill()
print("alive")
"""


@pytest.mark.parametrize("launcher_dies", ["before", "after"])
def test_worker_dies_with_launcher_even_one_that_died_before_it_bound(tmp_path, launcher_dies):
    """`detpipe.core.lifeline.die_with_launcher` under a subreaper: a worker whose launcher died ``before`` the call
    (its parent pid is the subreaper's now, not 1) is SIGKILLed in the call; one whose launcher dies ``after``
    it, by the kernel."""
    out = tmp_path / "out"
    out.write_text("")
    tree = subprocess.run([sys.executable, "-c", _TREE, _WORKER, launcher_dies, str(out)], env=stage_env(),
                          capture_output=True, text=True, timeout=60)
    assert (tree.stdout.strip(), out.read_text()) == ("-9", "bound" * (launcher_dies == "after")), tree.stderr
