"""Session fixtures built ahead of need: one background thread builds them one at a time while tests run.

Most tests run one single-threaded process at a time (tiny params: ``train.threads: 1``, no DataLoader workers),
so on a 2-core machine one core idles through much of the run. The expensive session fixtures (the reproduced
repository, the Prefect server, trainings shared by several modules) do not depend on any test: tests/conftest.py
queues those the selected tests use (`schedule`, at the end of collection) and a background thread builds them
in that order, while the tests before their first user run in the foreground.

Builds are registered by name (`register`; tests/conftest.py registers the session fixtures, a test module may
register the expensive part of its own module fixture, which then runs in the background as well).
A fixture asks for its value with `get`: built already, it is returned; being built in the background, the
fixture waits for it; not started yet, it is built right there (in the foreground) and the background thread
skips it. A build that raised re-raises in every test that asks for it. The background thread runs its
subprocesses with the environment the session had when the queue was scheduled (`support.procs.use_env`), so a
test's ``monkeypatch.setenv`` never leaks into a fixture, and with ``OMP_NUM_THREADS=1`` (the background has one
core); they carry the run's reaper token like everything else.
Builds register what must be undone at the end of the session with `at_exit` (run by `finish`).
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable

from support import procs


class _Job:
    def __init__(self, build: Callable[[], Any]):
        self.build, self.started, self.done = build, False, threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.build()
        except BaseException as e:      # handed to the test that asks for the fixture
            self.error = e
        finally:
            self.done.set()


_lock = threading.Lock()
_jobs: dict[str, _Job] = {}
_order: list[str] = []
_exits: list[Callable[[], None]] = []
_builders: dict[str, Callable[[Any], Any]] = {}
_fixtures: dict[str, str] = {}
_factory: Any = None


def register(name: str, build: Callable[[Any], Any], fixture: str | None = None) -> None:
    """Declare build ``name``: ``build(tmp_path_factory)`` returns its value and may `get` others; it is worth
    building ahead when a selected test uses ``fixture`` (default: the fixture called ``name``)."""
    _builders[name] = build
    _fixtures[name] = fixture or name


def registered() -> dict[str, str]:
    """{build name: the fixture whose use makes it worth building ahead}, in registration order."""
    return dict(_fixtures)


def set_factory(factory: Any) -> None:
    """The session's ``tmp_path_factory``, handed to every build. Its base directory is created here, in the main
    thread: pytest creates it lazily on first use and that is not thread-safe (a build's ``mktemp`` racing a test's
    ``tmp_path`` made two base directories; ``mktemp`` then raised "... is not a normalized and relative path" —
    one CI run lost 10 tests to it; 1 in 20 two-thread tries reproduced it)."""
    global _factory
    factory.getbasetemp()
    _factory = factory


def schedule(names: list[str]) -> threading.Thread | None:
    """Queue the registered builds ``names``, in this order, and start the background thread that builds them;
    returns it (None when there is nothing to build)."""
    if not names:
        return None
    with _lock:
        for name in names:
            if name not in _jobs:
                _jobs[name] = _Job(lambda n=name: _builders[n](_factory))
                _order.append(name)
    thread = threading.Thread(target=_background, args=(dict(os.environ),), name="prebuild", daemon=True)
    thread.start()
    return thread


def _background(env: dict[str, str]) -> None:
    # One intra-op thread for what the background starts (evaluate, export, ...: torch's default is one per
    # core): two OpenMP teams spinning on two cores slow each other down many times over.
    procs.use_env({**env, "OMP_NUM_THREADS": "1"})
    while True:
        with _lock:
            job = next((_jobs[n] for n in _order if not _jobs[n].started), None)
            if job is None:
                return
            job.started = True
        job.run()


def get(name: str) -> Any:
    """The value of registered fixture ``name``: the background build's (waiting for it if it is under way), else
    built now, in the calling thread. Raises what the build raised."""
    with _lock:
        job = _jobs.setdefault(name, _Job(lambda: _builders[name](_factory)))
        mine = not job.started
        job.started = True
    if mine:
        job.run()
    job.done.wait()
    if job.error is not None:
        raise job.error
    return job.result


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
    """Run every `at_exit` callback (newest first), each once, even when one raises; then raise the first error."""
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
