"""Errors a user sees: one line naming the file, the record and the rule broken (exit status 2), or naming the
signal that interrupted the stage (exit status 128 + signal number, the shell's convention)."""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

# Set by a launching `run_program` for its torchrun workers: where rank 0 leaves its interrupt message, so that the
# launcher prints it as the one line (workers and launcher all receive the signal).
_NOTE_ENV = "DETPIPE_INTERRUPT_NOTE"


class StageError(Exception):
    """Bad input or a failed check. The message is one line naming the file/record and the rule broken."""


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived (raised by `run_program`'s handler). A ``BaseException`` like
    ``KeyboardInterrupt``, so ``except Exception`` blocks do not swallow it; ``finally`` blocks and context
    managers still clean up (atomic outputs are then left as they were).

    ``detail`` says where the stage stopped (e.g. ``at iteration 12; checkpoint ckpt-0000010.pt kept``); code
    that knows sets it and re-raises."""

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(signum)
        self.signum, self.detail = signum, detail

    def message(self, stage: str) -> str:
        """``interrupted by SIGTERM <detail or "in stage <stage>">``."""
        return f"interrupted by {signal.Signals(self.signum).name} {self.detail or f'in stage {stage}'}"


_received: int | None = None


def received_signal() -> int | None:
    """The SIGTERM/SIGINT `run_program` received in this process, or None. An error that follows one (e.g. a DDP
    collective failing because another rank already stopped) is part of the interrupt, not a bug."""
    return _received


def _raise_interrupted(signum, frame) -> None:
    global _received
    if _received is not None:
        # Stopping already: a second SIGTERM/SIGINT (another sender, or `_watch_signals`' nudge racing the first
        # one's handler) must not abort the cleanup under way - `atomic_open` removing its temporary file, the
        # ``finally`` blocks - which would leave a half-written file. SIGKILL still stops the process at once.
        return
    _received = signum
    raise Interrupted(signum)


NUDGE_S = 2.0  # seconds a signal may wait for the main thread before it is sent to that thread itself


def _watch_signals() -> None:
    """Make sure a SIGTERM/SIGINT reaches the main thread. The kernel may deliver a process's signal to any of
    its threads (numpy, pyarrow and torch start their own); Python then runs the handler only when the main
    thread next runs Python code, which a blocking call (a socket read with a long timeout) can delay for
    minutes. A daemon thread reads the signal numbers Python writes to its wakeup fd; if `_raise_interrupted`
    (still the installed handler: torchrun's agent installs its own while it runs) has not run `NUDGE_S`
    seconds later, it sends the signal to the main thread itself (``pthread_kill``), interrupting the call.
    Must be called from the main thread; a no-op elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    main_id = threading.main_thread().ident

    def loop() -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            for signum in sorted(set(data) & {signal.SIGTERM, signal.SIGINT}):
                time.sleep(NUDGE_S)
                if _received is None and signal.getsignal(signum) is _raise_interrupted:
                    signal.pthread_kill(main_id, signum)

    threading.Thread(target=loop, name="signal-to-main-thread", daemon=True).start()


def _signal_of(e: BaseException) -> int | None:
    """The signal number of an interrupt: ours, Ctrl-C's, or torchrun's ``SignalException`` (its agent
    installs its own handlers while workers run; it stops them with the same signal, then raises)."""
    if isinstance(e, Interrupted):
        return e.signum
    if isinstance(e, KeyboardInterrupt):
        return signal.SIGINT
    if type(e).__name__ == "SignalException" and hasattr(e, "sigval"):
        return int(e.sigval)
    return None


def run_program(main: Callable[[], None], stage: str | None = None) -> None:
    """Run ``main`` (a stage's, or a tool's such as ``python -m detpipe.orchestration.repair``) as a program: configure
    logging, turn `StageError` into a one-line ``error: ...``
    on stderr and exit status 2, and SIGTERM/SIGINT into one line ``error: interrupted by SIGTERM ...`` and exit
    status 128 + signal (no traceback). Other exceptions propagate (bugs).

    ``stage`` defaults to the last part of ``main``'s module name (``python -m stages.convert`` -> ``convert``). In a torchrun
    worker (``LOCAL_RANK`` set) only rank 0 reports an interrupt; when the launcher is a `run_program` too, rank 0
    hands its message to the launcher, which prints it, so the user sees one line. Before ``main`` runs, the
    objects made so far (the imports) are frozen (`gc.freeze`).
    """
    if stage is None:
        module = main.__module__
        if module == "__main__":  # python -m stages.X: the module's real name is in its spec
            spec = getattr(sys.modules["__main__"], "__spec__", None)
            module = spec.name if spec else Path(sys.argv[0]).stem
        stage = module.rpartition(".")[2]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _raise_interrupted)
    _watch_signals()
    worker = "LOCAL_RANK" in os.environ
    note = None
    if not worker:
        note = Path(tempfile.gettempdir()) / f"detpipe-interrupt-{os.getpid()}"
        note.unlink(missing_ok=True)
        os.environ[_NOTE_ENV] = str(note)
    # What the program imported so far (torch, torchvision: millions of objects that live until exit) goes to
    # the collector's permanent generation: no later collection traverses it again, nor the one at exit (about
    # 0.7 s of CPU per stage process that imported torchvision; objects made from here on are collected as before).
    gc.freeze()
    try:
        main()
    except StageError as e:
        _exit(_read_note(note) or (2, f"error: {e}"))  # a worker's interrupt explains its failure
    except BaseException as e:
        signum = _signal_of(e) or _received
        if signum is None:
            raise
        for s in (signal.SIGTERM, signal.SIGINT):  # a second signal must not interrupt the report
            signal.signal(s, signal.SIG_IGN)
        line = "error: " + (e if isinstance(e, Interrupted) else Interrupted(signum)).message(stage)
        if not worker:
            _exit(_read_note(note) or (128 + signum, line))
        if os.environ.get("RANK", "0") == "0":
            if _NOTE_ENV in os.environ:
                Path(os.environ[_NOTE_ENV]).write_text(f"{128 + signum}\t{line}")
            else:
                print(line, file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    finally:
        if note is not None:
            note.unlink(missing_ok=True)


def _read_note(note: Path | None) -> tuple[int, str] | None:
    """``(exit status, line)`` left by a worker's `run_program` in ``note``, or None."""
    try:
        status, line = note.read_text().split("\t", 1)
        return int(status), line
    except (AttributeError, OSError, ValueError):
        return None


def _exit(status_line: tuple[int, str]) -> None:
    print(status_line[1], file=sys.stderr, flush=True)
    sys.exit(status_line[0])
