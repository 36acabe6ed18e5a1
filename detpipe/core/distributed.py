"""Distributed setup inside a worker (the worker side of the process boundary, as detectron2's ``utils/comm``): init
the process group with a collective timeout, and turn a collective that failed (timed out, or its peer went away)
into one line naming the collective and the lost peer. Launching the workers (torchrun, Slurm, Kubernetes) is
`detpipe.launch` (`detpipe.launch.torchrun`), which this module does not import: the timeout arrives in the
environment (`detpipe.core.worker_env.COLLECTIVE_TIMEOUT_ENV`). A worker ties its life to its launcher's with
`detpipe.core.lifeline.die_with_launcher`."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from detpipe.core.worker_env import COLLECTIVE_TIMEOUT_ENV


DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
"""Seconds a collective may wait for its peers when the launcher set no timeout (the default of
``train.collective_timeout_s``)."""

ROLL_CALL_S = 10.0
"""Seconds a rank whose collective timed out waits for the others to answer the roll call (`collective_failure`)."""

_peers: list[str] = []  # "host <hostname> pid <pid>" of every rank, gathered at init


def collective_timeout_s() -> float:
    """Seconds from ``$DETPIPE_COLLECTIVE_TIMEOUT_S``, else `DEFAULT_COLLECTIVE_TIMEOUT_S`.

    Raises:
        ValueError: the variable is not a positive number.
    """
    value = float(os.environ.get(COLLECTIVE_TIMEOUT_ENV) or DEFAULT_COLLECTIVE_TIMEOUT_S)
    if not value > 0:
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV}={value}: must be > 0 seconds")
    return value


def setup_distributed(backend: str | None = None) -> tuple[int, int, int, torch.device]:
    """Init the process group from torchrun's env (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``): nccl with one
    GPU per local rank when CUDA is available, else gloo (``backend`` forces one, e.g. gloo for gathering
    Python objects). Without torchrun (``WORLD_SIZE`` unset) nothing is initialized.

    Every collective of the group fails after `collective_timeout_s` seconds without its peers (``timeout=`` of
    ``init_process_group``; torch's own defaults are 30 min for gloo, 10 min for nccl), instead of blocking on a
    peer that dropped off the network without a TCP reset. gloo raises the timeout in the calling thread
    (``RuntimeError: ... Timed out waiting <ms>ms for recv operation to complete``; see `collective_failure`).
    nccl collectives do not block the CPU: torch's watchdog thread sees the timeout and, with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (torch's default since 2.2, set here unless the user chose another
    value), tears the process down after logging ``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..,
    OpType=..., Timeout(ms)=...)`` (https://pytorch.org/docs/stable/torch_nccl_environment_variables.html).
    Either way the worker exits nonzero and torchrun's agent restarts the group.

    Returns:
        ``(rank, world_size, local_rank, device)``: the device is ``cuda:<local_rank>`` or ``cpu``.
    Raises:
        ValueError: ``$DETPIPE_COLLECTIVE_TIMEOUT_S`` is not a positive number.
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the watchdog ends the process
        dist.init_process_group(backend, timeout=timedelta(seconds=collective_timeout_s()))
        _peers[:] = [""] * world
        dist.all_gather_object(_peers, f"host {socket.gethostname()} pid {os.getpid()}")
    return rank, world, local_rank, device


def _timed_out(e: BaseException) -> bool:
    """Whether a collective's error says it timed out: gloo's ``Timed out waiting <ms>ms for <op> operation``,
    gloo's ``Application timeout caused pair closure`` (raised in every other operation pending on the group when
    one of them times out: gloo ``transport/tcp/unbound_buffer.cc``, ``UnboundBuffer::waitRecv``; which of the two
    a worker sees first is a race), nccl's ``collective operation timeout``, or a `torch.distributed.DistError`
    (backend or store) that says ``timed out`` / ``timeout``."""
    text = str(e)
    return bool(re.search(r"Timed out waiting|Application timeout caused pair closure|collective operation timeout",
                          text)) or (
        isinstance(e, dist.DistError) and bool(re.search(r"timed out|timeout", text, re.IGNORECASE)))


def _roll_call(wait_s: float) -> set[int] | None:
    """Ranks of the group that answer within ``wait_s`` seconds: each rank whose collective failed writes a key
    into the workers' rendezvous store (``MASTER_ADDR:MASTER_PORT``, hosted by torchrun's agent, not by a worker)
    and waits for the others'. None when the store itself did not answer (its host is the one lost)."""
    answered: list[set[int]] = []

    def ask() -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=wait_s))
        prefix = (f"detpipe/roll-call/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
        store.set(f"{prefix}{rank}", "here")
        deadline = time.monotonic() + wait_s
        while True:
            here = {r for r in range(world) if store.check([f"{prefix}{r}"])}
            if len(here) == world or time.monotonic() > deadline:
                answered.append(here)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=ask, name="roll-call", daemon=True)
    thread.start()
    thread.join(2 * wait_s + 5)
    return answered[0] if answered else None


def collective_failure(e: BaseException) -> str | None:
    """One line for an error raised by a collective of the initialized group, or None for any other error.

    A timeout (gloo's ``Timed out waiting ...`` or ``Application timeout caused pair closure``, see `_timed_out`;
    after `collective_timeout_s`) names the timeout and the ranks that did not answer a roll call (`_roll_call`,
    at most `ROLL_CALL_S` s) with their host and pid; a connection the peer closed (gloo: ``Connection closed by
    peer [addr]:port``, the peer process died) names that address. E.g. ``rank 0/2 (host a): a collective timed
    out after 600 s (train.collective_timeout_s) - no answer from rank 1 (host b pid 4711): lost or frozen;
    torchrun restarts the group``."""
    if not dist.is_available() or not dist.is_initialized() or not isinstance(e, RuntimeError):
        return None
    text, rank, world = str(e), dist.get_rank(), dist.get_world_size()
    me = f"rank {rank}/{world} ({_peers[rank] if _peers else 'host ' + socket.gethostname()})"
    closed = re.search(r"Connection closed by peer \[?([^\]\s]+)\]?:(\d+)", text)
    if closed:
        return (f"{me}: a collective failed: connection closed by peer {closed.group(1)}:{closed.group(2)} "
                f"(a worker there died); torchrun restarts the group")
    if not _timed_out(e):
        return None
    line = f"{me}: a collective timed out after {collective_timeout_s():g} s (train.collective_timeout_s)"
    here = _roll_call(min(ROLL_CALL_S, collective_timeout_s()))
    if here is None:
        store = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        lost = f"the rendezvous store at {store} did not answer either (its host is lost)"
    else:
        missing = [f"rank {r}" + (f" ({_peers[r]})" if _peers else "") for r in range(world) if r not in here]
        lost = ("no answer from " + ", ".join(missing) + ": lost or frozen") if missing else \
            "every rank answered the roll call: a rank was busier than the timeout (raise it)"
    return f"{line} - {lost}; torchrun restarts the group"


@contextlib.contextmanager
def collective_errors() -> Iterator[None]:
    """Turn a failed collective raised inside (`collective_failure`) into a `detpipe.core.errors.StageError` with its
    one line (a worker under `detpipe.core.errors.run_program` then prints ``error: <line>`` and exits with status 2,
    and torchrun's agent restarts the group); other errors pass through unchanged."""
    from detpipe.core.errors import StageError

    try:
        yield
    except RuntimeError as e:
        line = collective_failure(e)
        if line is None:
            raise
        raise StageError(line) from None
