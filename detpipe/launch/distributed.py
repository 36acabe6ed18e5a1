"""Distributed setup inside a worker: init the process group. Launching the workers (torchrun, Slurm, Kubernetes)
is `detpipe.launch.torchrun`; a worker ties its life to its launcher's with `detpipe.lifeline.die_with_launcher`."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


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
