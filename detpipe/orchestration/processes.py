"""Commands a flow run starts, bound to the run's life (Linux): nothing they start outlives the run.

Process tree of a stage run by the flow::

    serve / worker ─ flow-run process ─ guard (python detpipe/orchestration/processes.py) ─ dvc repro ─ stage ─ torchrun workers

* The flow-run process calls `detpipe.core.lifeline.die_with_parent`: the kernel SIGKILLs it when the serve/worker
  process that started it dies (``prctl(PR_SET_PDEATHSIG)``), so a killed ``python -m flows.serve`` takes its
  runs with it; their Prefect heartbeats stop and the server marks them Crashed (see flows/serve.py). The
  torchrun workers bind themselves to their launcher the same way (`detpipe.core.lifeline.die_with_launcher`).
* Each command runs under a guard process (`guard`), which is a child subreaper (``PR_SET_CHILD_SUBREAPER``:
  whatever its command leaves behind is reparented to it, never to init) and gets SIGTERM from the kernel when
  the flow-run process dies. On SIGTERM/SIGINT, or when the command exits, it stops everything below it as a
  terminal's Ctrl-C would: SIGINT to the command's process group (DVC then releases its lock and the stage
  stops; DVC's documented way to interrupt a stage), SIGKILL to every process still below it after
  `GRACE_S` seconds.

Why not prefect-shell's ``ShellOperation``: on close it sends SIGTERM and, 5 s later, SIGKILL to the shell's
process group. SIGTERM ends DVC without releasing ``.dvc/tmp/rwlock``, and processes that left the group or
outlive a killed flow-run process are not reached; it also logs stderr apart from stdout, out of order.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

if not __package__:  # run as a file by `run_logged` (the guard): import detpipe from this file's own checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from detpipe.core.lifeline import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, prctl  # noqa: E402

GRACE_S = 15.0        # SIGINT -> SIGKILL (seconds); Prefect's runner allows 30 s between its SIGTERM and SIGKILL


class CommandError(RuntimeError):
    """A command exited with a non-zero status; the message quotes its last ``error`` lines."""


def child_env() -> dict[str, str]:
    """Environment for DVC and the stages: this interpreter's ``bin`` first on ``PATH`` (the stages'
    ``python -m ...`` use the same environment), unbuffered output, telemetry off, no torchrun rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env |= {"PYTHONUNBUFFERED": "1", "DVC_NO_ANALYTICS": "1"}
    env.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    return env


def dvc(*args: str) -> list[str]:
    """The command line of ``dvc --wait-for-lock <args>`` run with this interpreter (``python -m dvc``): the one
    way detpipe.orchestration and flows/ start DVC (with `run_logged` or ``subprocess.run``)."""
    return [sys.executable, "-m", "dvc", "--wait-for-lock", *args]


def git(cwd: Path, *args: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``git <args>`` in ``cwd`` with its output captured as text (not logged; `run_logged` logs a command),
    never prompting for credentials (``GIT_TERMINAL_PROMPT=0``).

    Args:
        check: raise when git exits with a non-zero status (else read ``returncode``).
        timeout: seconds before the command is killed (None: no limit).
    Raises:
        subprocess.CalledProcessError: ``check`` and a non-zero exit status.
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds.
        OSError: no ``git`` executable.
    """
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=check, timeout=timeout,
                          env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})


def run_logged(cmd: list[str], cwd: Path, logger) -> list[str]:
    """Run ``cmd`` in ``cwd`` under a `guard` and send each line of its stdout+stderr to ``logger`` as it comes.

    If this process is interrupted (Prefect cancellation's SIGTERM, Ctrl-C), the guard stops the command
    (SIGINT, then SIGKILL after `GRACE_S` s) before the exception propagates; if this process is killed, the
    kernel tells the guard, which does the same.
    Returns:
        the output lines (blank ones dropped).
    Raises:
        CommandError: non-zero exit status; the message quotes the command's ``error:``/``ERROR:`` lines.
    """
    logger.info("$ %s", " ".join(cmd))
    lines: list[str] = []
    proc = subprocess.Popen([sys.executable, __file__, str(os.getpid()), *cmd], cwd=cwd,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace")
    try:
        for line in proc.stdout:
            if line.strip():
                lines.append(line.rstrip())
                logger.info("%s", line.rstrip())
        rc = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: the guard stops the command; its last words go to the log
            proc.terminate()
            for line in proc.stdout:
                logger.info("%s", line.rstrip())
            proc.wait()
    if rc:
        errors = [ln.strip() for ln in lines if ln.lstrip().lower().startswith("error")]
        detail = "; ".join(errors[-3:]) or (lines[-1] if lines else "no output")
        raise CommandError(f"`{' '.join(cmd)}` exited with status {rc}: {detail}")
    return lines


def stop_tree(child: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGINT ``child``'s process group if it still runs, wait up to ``grace_s`` seconds for every descendant
    of this process to exit, then SIGKILL those left; exited orphans reparented here are reaped."""
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while (left := _live_descendants(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)
    child.wait()
    _live_descendants(child)


def _live_descendants(child: subprocess.Popen) -> list[psutil.Process]:
    """Descendants of this process still running; zombie orphans (not ``child``, which Popen reaps) are reaped."""
    alive = []
    child.poll()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
            elif p.pid != child.pid:
                os.waitpid(p.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            continue
    return alive


def guard(parent: int, cmd: list[str]) -> int:
    """Run ``cmd`` in its own session as a child subreaper bound to process ``parent`` (see the module
    docstring); return its exit status (128 + signal number if it was stopped by one)."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        return 128 + signal.SIGTERM
    child = subprocess.Popen(cmd, start_new_session=True)
    while child.poll() is None and not stopping:
        time.sleep(0.2)
    stop_tree(child, GRACE_S if child.poll() is None else 1.0)
    rc = child.returncode if child.returncode >= 0 else 128 - child.returncode
    return 128 + signal.SIGTERM if stopping else rc


if __name__ == "__main__":
    sys.exit(guard(int(sys.argv[1]), sys.argv[2:]))
