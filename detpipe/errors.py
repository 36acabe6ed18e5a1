"""Errors a user sees: one line naming the file, the record and the rule broken; exit status 2."""
from __future__ import annotations

import logging
import sys
from typing import Callable

log = logging.getLogger("stages")


class StageError(Exception):
    """Bad input or a failed check. The message is one line naming the file/record and the rule broken."""


def run_stage(main: Callable[[], None]) -> None:
    """Run a stage's ``main`` as a program: configure logging, turn `StageError` into a one-line
    ``error: ...`` on stderr and exit status 2 (no traceback). Other exceptions propagate (bugs)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        main()
    except StageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
