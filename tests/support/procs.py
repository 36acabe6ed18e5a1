"""Processes and ports for tests: one free-port helper, one run-and-check helper, one stopper."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

GIT_IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
                "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (``net.ipv4.ip_local_port_range``; Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago (all bound at once, then released).

    The ports are drawn at random from 10000 up to the kernel's ephemeral range, not from it: a port the kernel
    hands out (``bind(0)``) is one every outgoing connection of every process may take next, and did once
    between this function and the server's own bind (EADDRINUSE in CI). Ports below the range are only ever
    taken by an explicit bind, such as another test's server: two pytest workers drawing the same one of
    ~22 000 ports a moment apart is what remains. A machine whose range starts below 11000 gets the kernel's.

    Raises:
        RuntimeError: fewer than ``n`` free ports found in ``200 * n`` draws."""
    low, high = 10000, _ephemeral_start()
    socks: list[socket.socket] = []
    try:
        for _ in range(200 * n):
            if len(socks) == n:
                break
            s = socket.socket()
            try:        # a port drawn twice fails here: the first socket still holds it
                s.bind((host, random.randrange(low, high) if high - low >= 1000 else 0))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise RuntimeError(f"found {len(socks)} of {n} free TCP ports on {host} below port {high}")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port that was free on ``host`` a moment ago."""
    return free_ports(1, host)[0]


_thread = threading.local()


def use_env(env: dict[str, str]) -> None:
    """Make `stage_env` in the calling thread start from ``env`` instead of ``os.environ`` (a background thread
    building fixtures keeps the session's environment while tests change theirs)."""
    _thread.env = dict(env)


def stage_env(extra: dict | None = None, drop: tuple[str, ...] = ()) -> dict:
    """The environment for subprocesses of tests: this one (or the thread's, `use_env`) without torchrun's rank
    variables, the repository
    on ``PYTHONPATH`` (``python -m stages.X`` outside the root), this interpreter's ``bin/`` first on ``PATH``
    (``python``, ``dvc``, ``torchrun`` in dvc.yaml's commands), analytics off, a git identity; then ``extra``
    added and the names in ``drop`` removed."""
    base = getattr(_thread, "env", None) or os.environ
    env = {k: v for k, v in base.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    for key, value in GIT_IDENTITY.items():
        env.setdefault(key, value)
    env.update(extra or {})
    for key in drop:
        env.pop(key, None)
    return env


def run(cmd: list[str], cwd: Path, env: dict | None = None, check: bool = True, timeout: float = 900,
        drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``cwd`` with `stage_env` (+ ``env``, - ``drop``), output captured as text; with ``check``
    an exit status other than 0 fails the test with the command and the tails of its stdout and stderr."""
    proc = subprocess.run(cmd, cwd=cwd, env=stage_env(env, drop), capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def stop_group(procs: subprocess.Popen | list[subprocess.Popen], term_s: float = 20, kill_s: float = 10) -> None:
    """SIGTERM the process group of each of ``procs`` (started with ``start_new_session=True``) at once, SIGKILL
    the groups still there after ``term_s`` seconds; returns once every one of ``procs`` is reaped or ``kill_s``
    more seconds passed. Stopping them together costs the slowest one's shutdown, not the sum."""
    procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
    for sig, wait in ((signal.SIGTERM, term_s), (signal.SIGKILL, kill_s)):
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        procs = [p for p in procs if not _reaped(p, deadline)]
        if not procs:
            return


def _reaped(proc: subprocess.Popen, deadline: float) -> bool:
    """Whether ``proc`` exits (and is reaped) before the monotonic ``deadline``."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


def in_child(body, *args):
    """Run ``body(*args)`` (a module-level function of a test module: spawn pickles it by name) in a fresh spawned Python process and return its result; an
    assertion that fails there fails here with its message. OpenVINO (its TBB threads) and onnxruntime's quantizer
    then never load into the pytest process, which runs hundreds of other tests: a full CI run whose pytest process
    had run them in-process died later of SIGSEGV, in an unrelated test, with no Python traceback."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(body, args)
