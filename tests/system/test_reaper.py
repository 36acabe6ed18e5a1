"""support.reaper: what the tests start dies with the test run even when pytest is SIGKILLed.

Each test runs an inner pytest (its own conftest calls ``reaper.start()`` like tests/conftest.py, or not, for
the control) whose test starts real processes: a ``sleep`` in its own session, a child with a grandchild,
and a double-forked daemon (reparented to init). The outer test kills the inner pytest and watches them."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from support import reaper

TESTS = Path(__file__).resolve().parents[1]
TAG = "DETPIPE_REAPER_TEST_TAG"  # on everything an inner run starts: lets the outer test clean up after itself

CONFTEST = """
import sys
sys.path.insert(0, {tests!r})
from support import reaper


def pytest_configure(config):
    if {use_reaper!r} and not hasattr(config, "workerinput"):
        reaper.start()
"""

INNER_TEST = r'''
import json, os, subprocess, sys, time
from pathlib import Path

from support import reaper

OUT = Path({out!r})
CHILD = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(grandchild.pid, flush=True)
time.sleep(300)
"""
DAEMON = """
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
os.close(0)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""

HIDDEN = """
import sys, time
held = open(sys.argv[1], "a")
print("open", flush=True)
time.sleep(300)
"""


def test_start_processes():
    # a process without the token (an environment from scratch, as slurmstepd hides its own) that holds a file
    # open under a folder given to reaper.guard_dir
    guarded = OUT / "guarded"
    guarded.mkdir(exist_ok=True)
    reaper.guard_dir(guarded)
    hidden = subprocess.Popen([sys.executable, "-c", HIDDEN, str(guarded / "held.log")], stdout=subprocess.PIPE,
                              text=True, start_new_session=True,
                              env={{"DETPIPE_REAPER_TEST_TAG": os.environ.get("DETPIPE_REAPER_TEST_TAG", "")}})
    assert hidden.stdout.readline() == "open\n"
    session = subprocess.Popen(["sleep", "300"], start_new_session=True)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    daemon_file = OUT / "daemon.pid"
    subprocess.run([sys.executable, "-c", DAEMON, str(daemon_file)], check=True, timeout=60)
    deadline = time.time() + 60
    while not daemon_file.exists():
        assert time.time() < deadline
        time.sleep(0.05)
    pids = {{"hidden": hidden.pid, "session": session.pid, "child": child.pid, "grandchild": grandchild,
             "daemon": int(daemon_file.read_text()), "pytest": os.getpid(), "watchdog": reaper.watchdog_pid,
             "token": reaper.token, "log": str(reaper.log_path) if reaper.log_path else None}}
    (OUT / "pids.json.tmp").write_text(json.dumps(pids))
    os.replace(OUT / "pids.json.tmp", OUT / "pids.json")
    if {finish!r}:
        return  # pytest exits normally, leaving the processes behind
    time.sleep(600)
'''

STARTED = ("hidden", "session", "child", "grandchild", "daemon")


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if not _gone(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _tagged(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(TAG) == tag:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_gone(procs, 10)


class Inner:
    """An inner pytest run in ``tmp``: started, its processes read from its pid file, everything cleaned up."""

    def __init__(self, tmp: Path, use_reaper: bool, finish: bool = False):
        self.dir, self.tag = tmp / "inner", secrets.token_hex(8)
        self.dir.mkdir()
        (self.dir / "pytest.ini").write_text("[pytest]\n")
        (self.dir / "conftest.py").write_text(CONFTEST.format(tests=str(TESTS), use_reaper=use_reaper))
        (self.dir / "test_inner.py").write_text(INNER_TEST.format(out=str(self.dir), finish=finish))
        self.env = {**os.environ, TAG: self.tag, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                    reaper.GRACE_ENV: "3"}
        self.proc: subprocess.Popen | None = None
        self.others: list[subprocess.Popen] = []

    def start(self) -> dict:
        self.proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s",
                                      str(self.dir)], cwd=self.dir, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=open(self.dir / "out.txt", "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        pid_file, deadline = self.dir / "pids.json", time.monotonic() + 60
        while not pid_file.exists():
            assert self.proc.poll() is None or pid_file.exists(), self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.05)
        self.pids = json.loads(pid_file.read_text())
        self.started = [psutil.Process(self.pids[k]) for k in STARTED]
        return self.pids

    def unrelated(self, marker_value: str | None) -> psutil.Process:
        """A ``sleep`` started by the outer test: no marker, or the marker with a value that is not the token."""
        env = {k: v for k, v in os.environ.items() if k != reaper.MARKER}
        if marker_value is not None:
            env[reaper.MARKER] = marker_value
        proc = subprocess.Popen(["sleep", "300"], env={**env, TAG: self.tag})
        self.others.append(proc)
        return psutil.Process(proc.pid)

    def output(self) -> str:
        return (self.dir / "out.txt").read_text(errors="replace")[-3000:]

    def cleanup(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        _kill(_tagged(self.tag))
        for p in self.others:
            p.wait(timeout=10)


def test_killed_pytest_takes_its_processes_along(tmp_path):
    inner = Inner(tmp_path, use_reaper=True)
    try:
        pids = inner.start()
        assert pids["watchdog"], inner.output()
        watchdog = psutil.Process(pids["watchdog"])
        assert watchdog.ppid() != pids["pytest"]  # detached
        assert reaper.MARKER not in watchdog.environ()  # never a target of a watchdog
        token = pids["token"]
        assert token in psutil.Process(pids["daemon"]).environ()[reaper.MARKER].split(os.pathsep)
        bystanders = [inner.unrelated(None), inner.unrelated("some-other-run"), inner.unrelated(token + "0")]
        for sig in (signal.SIGINT, signal.SIGHUP):  # Ctrl-C or a closed terminal do not stop it
            watchdog.send_signal(sig)
        time.sleep(0.3)
        assert not _gone(watchdog)
        assert all(not _gone(p) for p in inner.started)
        t0 = time.monotonic()
        inner.proc.kill()
        inner.proc.wait(timeout=10)
        left = _wait_gone(inner.started, 15)
        took = time.monotonic() - t0
        assert not left, f"survived the killed pytest: {left}"
        assert took < 10, took  # SIGTERM was enough: no grace period waited out
        assert not _wait_gone([watchdog], 15), "the watchdog did not exit"
        assert all(not _gone(p) for p in bystanders), "killed a process without the token"
        log = Path(pids["log"]).read_text()
        for k in STARTED:
            assert f"SIGTERM {pids[k]} " in log, log
        Path(pids["log"]).unlink()
    finally:
        inner.cleanup()


def test_normal_exit_sweeps_leftovers_and_the_watchdog_exits(tmp_path):
    inner = Inner(tmp_path, use_reaper=True, finish=True)
    try:
        pids = inner.start()
        watchdog = psutil.Process(pids["watchdog"])
        assert inner.proc.wait(timeout=60) == 0, inner.output()
        assert not _wait_gone(inner.started, 15), "leftovers survived a normal exit"
        assert not _wait_gone([watchdog], 15), "the watchdog did not exit"
        Path(pids["log"]).unlink()
    finally:
        inner.cleanup()


def test_control_without_reaper_the_processes_outlive_pytest(tmp_path):
    """Shows that the check above can fail: without ``reaper.start()`` nothing kills them."""
    inner = Inner(tmp_path, use_reaper=False)
    try:
        pids = inner.start()
        assert pids["watchdog"] is None
        inner.proc.kill()
        inner.proc.wait(timeout=10)
        time.sleep(3)
        assert all(not _gone(p) for p in inner.started), "processes died without a reaper"
    finally:
        inner.cleanup()


def test_start_twice_in_one_process_keeps_the_token():
    if reaper.token is None:
        pytest.skip("tests/conftest.py does not call reaper.start() in this run")
    assert reaper.start() == reaper.token
    assert reaper.token in os.environ[reaper.MARKER].split(os.pathsep)
