"""Distributed setup inside a worker: init the process group, tie the worker's life to its launcher. Launching
the workers (torchrun, Slurm, Kubernetes) is `detpipe.launch`."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when its launcher dies (``prctl(PR_SET_PDEATHSIG)``), so a
    ``kill -9`` of the stage never leaves orphan workers writing checkpoints beside a resumed run."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def setup_distributed(backend: str | None = None) -> tuple[int, int, int, torch.device]:
    """Init the process group from torchrun's env (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``): nccl with one
    GPU per local rank when CUDA is available, else gloo (``backend`` forces one, e.g. gloo for gathering
    Python objects). Without torchrun (``WORLD_SIZE`` unset) nothing is initialized.

    Returns:
        ``(rank, world_size, local_rank, device)``: the device is ``cuda:<local_rank>`` or ``cpu``.
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"))
    return rank, world, local_rank, device
