"""Launch a stage's workers with torchrun, in this process, with one-line errors."""
from __future__ import annotations

import logging

from stages.common import StageError

log = logging.getLogger("stages.launch")


def launch_module(argv: list[str]) -> None:
    """Run ``torchrun <argv>`` in this process; a failed worker becomes a one-line `StageError` (the worker's
    own message is printed above it) instead of torchrun's traceback."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    log.info("launching: torchrun %s", " ".join(argv))
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = next(iter(e.failures.items()))
        raise StageError(f"{argv[-1]} failed: rank {rank} exited with code {failure.exitcode} "
                         f"(see its message above)") from None
