"""Bind every process the tests start to the life of the pytest process, even when pytest is SIGKILLed.

``start()`` (called once from ``pytest_configure`` in the main pytest process) puts a unique token into
``os.environ[marker]``, so every process the tests start inherits it (servers, ``dvc``, ``torchrun`` workers,
Slurm daemons and job steps: ``sbatch`` exports the environment by default). It then starts a watchdog,
this file run as a script, detached from pytest (its own session, reparented to init, SIGINT and SIGHUP
ignored). The watchdog waits for the pytest process to exit, however it exits (a pidfd where the kernel has
them, else polling), then sweeps: every process whose environment (``/proc/<pid>/environ``) carries the
token, with its descendants and the members of the process groups it leads, gets SIGTERM, and after a grace
period (``DETPIPE_REAPER_GRACE`` seconds, default 5) SIGKILL, in repeated sweeps until none is left (a dying
parent may start or orphan more). Processes without the token are never touched. Its log (what it killed)
is ``<tempdir>/detpipe-reaper-<token>.log``; it is removed when there was nothing to kill.

Nested test runs (a test that runs pytest) append their token to the marker (``outer:inner``, ``os.pathsep``
separated), so the inner run's processes die with either run; the watchdogs themselves never carry a token.

Processes that overwrite their environment block (``slurmstepd``: its ``setproctitle`` reuses the environ area)
and are reparented away from the token carriers are found another way: `guard_dir` registers a folder of the
test run (a Slurm cluster's spool and logs), and every process holding a file open under it, or working in it,
is swept too.

Caveats: a process started with an environment that is not built from ``os.environ`` (``env={...}`` from
scratch, ``sbatch --export=NONE``), a process that overwrites its environment block (``setproctitle``
implementations that reuse the environ area, e.g. ``slurmstepd``) and is no descendant or group member of a
token carrier, and processes of another user when the tests do not run as root, are not found.
"""
from __future__ import annotations

import argparse
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

MARKER = "DETPIPE_TEST_RUN"
GRACE_ENV = "DETPIPE_REAPER_GRACE"
DEFAULT_GRACE = 5.0
SWEEPS = 5  # SIGKILL sweeps after the SIGTERM one, until one finds nothing

# set by start() in the process that called it
token: str | None = None
log_path: Path | None = None
watchdog_pid: int | None = None


def start(marker: str = MARKER) -> str:
    """Tag this process's environment with a fresh token (in ``os.environ[marker]``) and start the watchdog
    that kills every process carrying the token once this process has exited. Returns the token; a second
    call in the same process returns the first token and starts nothing."""
    global token, log_path, watchdog_pid
    if token is not None:
        return token
    import psutil

    me = os.getpid()
    new = f"{me}-{secrets.token_hex(6)}"
    outer = os.environ.get(marker)
    os.environ[marker] = f"{outer}{os.pathsep}{new}" if outer else new
    token = new
    log_path = Path(tempfile.gettempdir()) / f"detpipe-reaper-{new}.log"
    env = {k: v for k, v in os.environ.items() if k != marker}  # the watchdog is no target of any watchdog
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(me)
        except OSError:
            pidfd = None
    ready_r, ready_w = os.pipe()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--pid", str(me),
           "--create-time", repr(psutil.Process(me).create_time()), "--token", new, "--marker", marker,
           "--ready-fd", str(ready_w), "--log", str(log_path)]
    fds = [ready_w]
    if pidfd is not None:
        cmd += ["--pidfd", str(pidfd)]
        fds.append(pidfd)
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env,
                                    cwd="/", start_new_session=True, pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    # the watchdog writes "ready <pid>" once it is detached and watching; EOF without it means it failed
    data, deadline = b"", time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            if select.select([ready_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
                chunk = os.read(ready_r, 256)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(ready_r)
    try:
        proc.wait(timeout=10)  # the intermediate process exits at once (the watchdog is its child)
    except subprocess.TimeoutExpired:
        pass
    if data.startswith(b"ready "):
        watchdog_pid = int(data.split()[1])
    else:
        warnings.warn(f"the test-process reaper did not start: processes the tests start may outlive a killed "
                      f"pytest; see {log_path}", RuntimeWarning, stacklevel=2)
    return token


def guard_dir(path: Path | str) -> None:
    """Also sweep, once this test run's pytest has exited, every process that holds a file open under ``path``
    or works in it (for daemons that hide their environment, e.g. ``slurmstepd``). A no-op before `start`."""
    if log_path is None:
        return
    with open(_dirs_file(log_path), "a") as f:
        f.write(str(Path(path).resolve()) + "\n")


def _dirs_file(log: Path | str) -> Path:
    return Path(str(log) + ".dirs")


# --------------------------------------------------------------------------------------------- watchdog


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} reaper[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


def _wait_for_exit(pid: int, create_time: float, pidfd: int | None) -> None:
    import psutil

    if pidfd is not None:
        try:
            select.select([pidfd], [], [])  # readable once the process has exited
            return
        except (OSError, ValueError) as e:
            _log(f"pidfd wait failed ({e}); polling")
    while True:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - create_time) > 0.05 or p.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.5)


def _carries(env: dict | None, marker: str, token: str) -> bool:
    return bool(env) and token in env.get(marker, "").split(os.pathsep)


def _under(p, dirs: list[str]) -> bool:
    """Whether process ``p`` works in, or holds a file open under, one of ``dirs``."""
    import psutil

    def inside(path: str) -> bool:
        return any(path == d or path.startswith(d + os.sep) for d in dirs)
    try:
        return inside(p.cwd()) or any(inside(f.path) for f in p.open_files())
    except (psutil.Error, OSError):
        return False


def find(marker: str, token: str, exclude: set[int], dirs: list[str] = ()) -> dict[int, "psutil.Process"]:
    """The live processes carrying ``token`` in ``marker`` or working in / holding files open under one of
    ``dirs`` (`guard_dir`), with their descendants and the members of the process groups they (or those
    descendants) lead; never a pid in ``exclude``."""
    import psutil

    procs, ppid, pgid, targets = {}, {}, {}, set()
    for p in psutil.process_iter():
        if p.pid in exclude:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            ppid[p.pid] = p.ppid()
            pgid[p.pid] = os.getpgid(p.pid)
            procs[p.pid] = p
            if _carries(p.environ(), marker, token) or (dirs and _under(p, dirs)):
                targets.add(p.pid)
        except (psutil.Error, OSError):
            continue
    changed = True
    while changed:  # closure over "child of a target" and "in a group led by a target"
        changed = False
        for pid in procs:
            if pid not in targets and (ppid.get(pid) in targets or pgid.get(pid) in targets):
                targets.add(pid)
                changed = True
    return {pid: procs[pid] for pid in targets}


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(p) -> str:
    try:
        cmd = " ".join(p.cmdline()) or p.name()
    except Exception:  # noqa: BLE001 - gone or unreadable: the pid still says which
        cmd = "?"
    return f"{p.pid} ({cmd[:200]})"


def _signal(procs, sig: int) -> list:
    import psutil

    sent = []
    for p in procs:
        what = _describe(p)
        try:
            p.send_signal(sig)  # psutil checks that the pid is still this process (no pid reuse)
            sent.append(p)
            _log(f"{signal.Signals(sig).name} {what}")
        except psutil.NoSuchProcess:
            pass
        except psutil.Error as e:
            _log(f"could not signal {p.pid}: {e}")
    return sent


def _wait_gone(procs, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _alive(p)]
    return alive


def reap(marker: str, token: str, grace: float, dirs: list[str] = ()) -> int:
    """SIGTERM everything ``find`` finds, SIGKILL what is left after ``grace`` seconds, then sweep again
    with SIGKILL until a sweep finds nothing. Returns how many processes were signalled."""
    import functools

    import psutil

    find_ = functools.partial(find, dirs=list(dirs))

    me = psutil.Process()
    exclude = {0, 1, me.pid} | {p.pid for p in me.parents()}
    targets = find_(marker, token, exclude)
    if not targets:
        return 0
    signalled = {p.pid for p in _signal(targets.values(), signal.SIGTERM)}
    left = {p.pid: p for p in _wait_gone(targets.values(), grace)}
    for _ in range(SWEEPS):
        left.update(find_(marker, token, exclude))
        left = {pid: p for pid, p in left.items() if _alive(p)}
        if not left:
            break
        signalled |= {p.pid for p in _signal(left.values(), signal.SIGKILL)}
        left = {p.pid: p for p in _wait_gone(left.values(), 2.0)}
    else:
        left = {pid: p for pid, p in {**left, **find_(marker, token, exclude)}.items() if _alive(p)}
        if left:
            _log("still alive: " + ", ".join(_describe(p) for p in left.values()))
    return len(signalled)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pid", type=int, required=True, help="the pytest process to outlive")
    ap.add_argument("--create-time", type=float, required=True, help="its psutil create_time (pid reuse)")
    ap.add_argument("--token", required=True)
    ap.add_argument("--marker", default=MARKER)
    ap.add_argument("--pidfd", type=int, help="a pidfd of --pid, inherited from it")
    ap.add_argument("--ready-fd", type=int, help="write 'ready <pid>' here once watching, then close it")
    ap.add_argument("--log", help="this process's stderr file: removed when there was nothing to kill")
    ap.add_argument("--grace", type=float, default=float(os.environ.get(GRACE_ENV, DEFAULT_GRACE)),
                    help=f"seconds between SIGTERM and SIGKILL (default ${GRACE_ENV} or {DEFAULT_GRACE})")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if os.fork():  # detach: the watchdog is no child of pytest (reparented to init or a subreaper)
        os._exit(0)
    _log(f"watching pid {args.pid} for {args.marker}={args.token}")
    if args.ready_fd is not None:
        os.write(args.ready_fd, f"ready {os.getpid()}\n".encode())
        os.close(args.ready_fd)
    _wait_for_exit(args.pid, args.create_time, args.pidfd)
    _log(f"pid {args.pid} has exited; sweeping")
    try:
        dirs = []
        if args.log and _dirs_file(args.log).exists():
            dirs = [d for d in _dirs_file(args.log).read_text().splitlines() if d]
            _dirs_file(args.log).unlink()
        n = reap(args.marker, args.token, args.grace, dirs)
    except Exception as e:  # noqa: BLE001 - log it, keep the log
        _log(f"sweep failed: {e!r}")
        raise
    _log(f"done: signalled {n} process(es)")
    if n == 0 and args.log:
        try:
            os.unlink(args.log)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
