"""Session fixtures built ahead of need by a background thread, and built once for every xdist worker.

Most tests run one single-threaded process at a time (tiny params: ``train.threads: 1``, no DataLoader workers),
so one core idles through much of a serial run. The expensive session fixtures (the reproduced repository, the
Prefect server, trainings shared by several modules) do not depend on any test: tests/conftest.py queues those the
selected tests use (`schedule`, at the end of collection) and a background thread builds them in that order, while
the tests before their first user run in the foreground.

Builds are registered by name (`register`; tests/conftest.py registers the session fixtures, a test module may
register the expensive part of its own module fixture, which then runs in the background as well).
A fixture asks for its value with `get`: built already, it is returned; being built in the background, the
fixture waits for it; not started yet, it is built right there (in the foreground) and the background thread
skips it. A build that raised re-raises in every test that asks for it. The background thread runs its
subprocesses with the environment the session had when the queue was scheduled (`support.procs.use_env`), so a
test's ``monkeypatch.setenv`` never leaks into a fixture, and with ``OMP_NUM_THREADS=1``; they carry the run's
reaper token like everything else. Builds register what must be undone at the end of the session with `at_exit`
(run by `finish`).

Under pytest-xdist (``-n 2``: two worker processes, `set_factory`'s ``shared``), a *shared* build (one whose value
is data on disk: work directories, repositories; the default) is built once for all workers: whoever builds it
holds ``<shared>/<name>.lock`` (``flock``) and leaves its value pickled in ``<shared>/<name>.pickle`` (or the
error in ``<name>.error``); a worker that asks meanwhile waits on the lock, then reads it. One background thread
for all workers (the holder of ``<shared>/background.lock``) builds the queued shared builds, skipping any that a
worker is building. A *local* build (``shared=False``: a server, or a value that holds one) belongs to the
process that built it: under xdist it is built ahead only by `schedule_local`, by the worker that runs the tests
needing it (tests/conftest.py keeps those tests in one xdist group).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from detpipe.core.files import atomic_write_bytes
from support import procs


class _Job:
    def __init__(self, name: str, build: Callable[[], Any]):
        self.name, self.build, self.started, self.done = name, build, False, threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self, lock: int | None = None) -> None:
        """Build (or, for a shared build another worker made, read) the value; ``lock``: the shared lock's file
        descriptor when the caller holds it already."""
        try:
            self.result = self.build() if _shared is None or not _is_shared[self.name] else self._shared(lock)
        except BaseException as e:      # handed to the test that asks for the fixture
            self.error = e
        finally:
            self.done.set()

    def _shared(self, lock: int | None) -> Any:
        fd = lock if lock is not None else _lock_file(self.name, block=True)
        try:
            value, error = _shared / f"{self.name}.pickle", _shared / f"{self.name}.error"
            if error.exists():
                raise RuntimeError(f"session fixture {self.name!r} failed in another xdist worker:\n"
                                   f"{error.read_text()}")
            if value.exists():
                return pickle.loads(value.read_bytes())
            try:
                result = self.build()
            except BaseException:
                atomic_write_bytes(error, traceback.format_exc().encode())
                raise
            atomic_write_bytes(value, pickle.dumps(result))
            return result
        finally:
            os.close(fd)


_lock = threading.Lock()
_jobs: dict[str, _Job] = {}
_order: list[str] = []
_exits: list[Callable[[], None]] = []
_builders: dict[str, Callable[[Any], Any]] = {}
_fixtures: dict[str, str] = {}
_is_shared: dict[str, bool] = {}
_factory: Any = None
_shared: Path | None = None
_stopping = False
_background_lock: int | None = None     # under xdist: the descriptor whose flock makes this the run's builder


def register(name: str, build: Callable[[Any], Any], fixture: str | None = None, shared: bool = True) -> None:
    """Declare build ``name``: ``build(tmp_path_factory)`` returns its value and may `get` others; it is worth
    building ahead when a selected test uses ``fixture`` (default: the fixture called ``name``). ``shared``: its
    value is picklable data that every xdist worker may use (not a running server, nor anything holding one)."""
    _builders[name] = build
    _fixtures[name] = fixture or name
    _is_shared[name] = shared


def registered() -> dict[str, str]:
    """{build name: the fixture whose use makes it worth building ahead}, in registration order."""
    return dict(_fixtures)


def is_shared(name: str) -> bool:
    """Whether build ``name`` is built once for all xdist workers (`register`'s ``shared``)."""
    return _is_shared[name]


def set_factory(factory: Any, shared: Path | None = None) -> None:
    """The session's ``tmp_path_factory``, handed to every build; ``shared``: a folder every xdist worker of the
    run sees (None without xdist), where shared builds leave their values. The factory's base directory is
    created here, in the main thread: pytest creates it lazily on first use and that is not thread-safe (a build's
    ``mktemp`` racing a test's ``tmp_path`` made two base directories; ``mktemp`` then raised "... is not a
    normalized and relative path" — one CI run lost 10 tests to it; 1 in 20 two-thread tries reproduced it)."""
    global _factory, _shared
    factory.getbasetemp()
    _factory = factory
    if shared is not None:
        (shared / "prebuild").mkdir(exist_ok=True)
        _shared = shared / "prebuild"


def _job(name: str) -> _Job:
    # with _lock held
    if name not in _jobs:
        _jobs[name] = _Job(name, lambda: _builders[name](_factory))
    return _jobs[name]


def schedule(names: list[str]) -> threading.Thread | None:
    """Queue the registered builds ``names``, in this order, and start the background thread that builds them;
    returns it (None when there is nothing to build). Under xdist only shared builds are queued, and only the
    first worker to call this starts a thread."""
    if _shared is not None:
        names = [n for n in names if _is_shared[n]]
        if not names:
            return None
        global _background_lock
        _background_lock = _lock_file("background", block=False)   # held until this process exits
        if _background_lock is None:          # another worker's thread builds them
            return None
    return _start(names)


def schedule_local(names: list[str]) -> threading.Thread | None:
    """Queue the local builds ``names`` and start a background thread in this process for them (under xdist: the
    worker about to run the tests that use them)."""
    names = [n for n in names if not _is_shared[n]]
    return _start(names) if names else None


def _start(names: list[str]) -> threading.Thread | None:
    with _lock:
        for name in names:
            if name not in _order:
                _job(name)
                _order.append(name)
    thread = threading.Thread(target=_background, args=(dict(os.environ), names), name="prebuild", daemon=True)
    thread.start()
    return thread


def _background(env: dict[str, str], names: list[str]) -> None:
    # One intra-op thread for what the background starts (evaluate, export, ...: torch's default is one per
    # core): two OpenMP teams spinning on two cores slow each other down many times over.
    procs.use_env({**env, "OMP_NUM_THREADS": "1"})
    skipped: set[str] = set()
    while True:
        lock = None
        with _lock:
            job = next((_jobs[n] for n in names if not _jobs[n].started and n not in skipped), None)
            if job is None or _stopping:
                return
            if _shared is not None and _is_shared[job.name]:
                lock = _lock_file(job.name, block=False)
                if lock is None:            # another worker is building it: its users wait on the lock
                    skipped.add(job.name)
                    continue
            job.started = True
        job.run(lock)


def get(name: str) -> Any:
    """The value of registered fixture ``name``: the background build's (waiting for it if it is under way), else
    built now, in the calling thread (under xdist, a shared build another worker is making: waited for, then
    read). Raises what the build raised."""
    with _lock:
        job = _job(name)
        mine = not job.started
        job.started = True
    if mine:
        job.run()
    job.done.wait()
    if job.error is not None:
        raise job.error
    return job.result


def _lock_file(name: str, block: bool) -> int | None:
    """An open descriptor holding an exclusive ``flock`` on ``<shared>/<name>.lock`` (released when it is closed,
    or when the process dies); None when ``block`` is False and another process holds it."""
    fd = os.open(_shared / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def at_exit(undo: Callable[[], None]) -> None:
    """Call ``undo`` at the end of the session (`finish`), after the tests; the last registered runs first."""
    with _lock:
        _exits.append(undo)


def enter(context):
    """Enter context manager ``context`` (a server) and return what it yields; it is exited at the end of the
    session (`at_exit`)."""
    stack = contextlib.ExitStack()
    at_exit(stack.close)
    return stack.enter_context(context)


def finish() -> None:
    """Let the background threads finish the build each has under way (under xdist another worker may be waiting
    for it) and start no other; then run every `at_exit` callback (newest first), each once, even when one
    raises; then raise the first error."""
    global _stopping
    with _lock:
        _stopping = True
        running = [job for job in _jobs.values() if job.started]
    for job in running:
        job.done.wait()
    errors = []
    while True:
        with _lock:
            if not _exits:
                break
            undo = _exits.pop()
        try:
            undo()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]
