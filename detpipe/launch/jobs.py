"""The train stage's launch: inputs checked before any worker starts, torchrun here (`detpipe.launch.torchrun`) or as
a Slurm job (`detpipe.launch.slurm`). The job descriptions for a scheduler (``python -m detpipe.launch.emit
slurm|k8s``) are `detpipe.launch.emit`'s: not imported here, so editing the Kubernetes manifest code does not touch the
train stage's code deps.

Every launch runs `TRAIN_MODULE` (``python -m stages.train``) in each worker. Only light modules are imported at the
top (standard library, pydantic, `detpipe.launch.torchrun` and `detpipe.launch.stage`): the heavy ones are imported where used.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from detpipe.core.errors import StageError
from detpipe.launch.stage import LaunchParams
from detpipe.launch.torchrun import launch_local
from detpipe.launch.torchrun_args import default_run_id, launch_env, torchrun_args

if TYPE_CHECKING:
    from detpipe.params import Train

TRAIN_MODULE = "stages.train"
"""The module each torchrun worker runs (``python -m stages.train``)."""


def check_inputs(cfg: Train) -> None:
    """Fail fast, before launching workers, on problems every worker would hit: missing inputs, unknown model,
    an SSD model on a cache of another size, a mask model on a cache without masks, a weights file that does not
    exist, an ``exp:``/``checkpoint:`` weights value that cannot be resolved (`detpipe.warm_start.materialise_weights`,
    which copies it to ``checkpoints/warm_start.pt`` for the workers).

    The model is built as each worker builds it (`detpipe.models.build_detector`, the same checks), but on the meta
    device: its structure only, no weights allocated or initialized (the workers build the real one).

    Raises:
        StageError: one line naming the setting or file and the problem.
    """
    from detpipe.core.files import is_url
    from detpipe.models import build_detector
    from detpipe.models.hf_weights import check_hub_offline, is_hub_id
    from detpipe.warm_start import is_warm_start, materialise_weights, warm_start_path
    from detpipe.core.paths import CKPT_DIR

    build_detector(cfg, device="meta")
    if is_warm_start(cfg.weights):  # copied before any worker starts (a fresh start deletes checkpoints)
        materialise_weights(cfg.weights, cfg.weights_sha256, warm_start_path(CKPT_DIR), CKPT_DIR)
        return
    if cfg.weights:
        check_hub_offline(cfg.weights)   # a hub id offline fails here, before torchrun starts
    if cfg.weights and not is_url(cfg.weights) and not Path(cfg.weights).exists() and not is_hub_id(cfg.weights) \
            and ("/" in cfg.weights or cfg.weights.endswith((".pt", ".pth", ".safetensors"))):
        raise StageError(f"params.yaml: key 'train.weights': file '{cfg.weights}' not found")


def launch_args(cfg: Train, endpoint: str | None = None, run_id: str | None = None) -> list[str]:
    """torchrun arguments of the train stage (see `detpipe.launch.torchrun_args.torchrun_args`): c10d rendezvous at
    ``endpoint`` (``host:port``; default ``train.rdzv_endpoint``) under job id ``run_id`` (default
    `detpipe.launch.torchrun_args.default_run_id`), running `TRAIN_MODULE`."""
    launch = LaunchParams.of_train(cfg)
    return torchrun_args(launch, TRAIN_MODULE, endpoint or cfg.rdzv_endpoint, run_id or default_run_id(launch))


def launch(cfg: Train) -> None:
    """``train.launcher: local`` (or inside a Slurm job): run torchrun here (`detpipe.launch.torchrun.launch_local`).
    ``slurm`` (outside a Slurm job): submit `slurm_job`'s sbatch script, stream its log to stdout, wait; cancel the job
    on SIGTERM/SIGINT.

    Raises:
        StageError: the job or a worker failed.
    """
    from detpipe.launch import slurm

    if cfg.launcher == "slurm" and "SLURM_JOB_ID" not in os.environ:
        slurm.run_job(slurm_job(cfg), Path.cwd())
    else:
        launch_local(LaunchParams.of_train(cfg), TRAIN_MODULE)


def slurm_job(cfg: Train) -> str:
    """The train stage's sbatch script for the current params (`detpipe.launch.slurm.sbatch_script`): torchrun's
    arguments with the rendezvous on the job's first node (``$RDZV_HOST``) under ``$SLURM_JOB_ID``."""
    from detpipe.launch import slurm

    port = cfg.rdzv_endpoint.rsplit(":", 1)[1]
    return slurm.sbatch_script(cfg, launch_args(cfg, f"${{RDZV_HOST}}:{port}", "${SLURM_JOB_ID}"),
                               launch_env(cfg), Path.cwd())


def check_and_launch(cfg: Train) -> None:
    """The train stage's launcher: `check_inputs`, then `launch`.

    Raises:
        StageError: as `check_inputs` and `launch`.
    """
    check_inputs(cfg)
    launch(cfg)
