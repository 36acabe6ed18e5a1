"""The train stage's launch: inputs checked before any worker starts, torchrun here (`detpipe.launch.torchrun`) or as
a Slurm job (`detpipe.launch.slurm`), or the job description for a scheduler (Slurm script, Kubernetes manifest).

Every launch runs `TRAIN_MODULE` (``python -m stages.train``) in each worker. Only light modules are imported at the
top (standard library and `detpipe.launch.torchrun`): the heavy ones are imported where used.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from detpipe.errors import StageError
from detpipe.launch.torchrun import default_run_id, launch_env, launch_local, torchrun_args

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
    from detpipe.files import is_url
    from detpipe.models import build_detector
    from detpipe.models.hf_weights import check_hub_offline, is_hub_id
    from detpipe.warm_start import is_warm_start, materialise_weights, warm_start_path
    from detpipe.paths import CKPT_DIR

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
    """torchrun arguments of the train stage (see `detpipe.launch.torchrun.torchrun_args`): c10d rendezvous at
    ``endpoint`` (``host:port``; default ``train.rdzv_endpoint``) under job id ``run_id`` (default
    `detpipe.launch.torchrun.default_run_id`), running `TRAIN_MODULE`."""
    return torchrun_args(cfg, TRAIN_MODULE, endpoint or cfg.rdzv_endpoint, run_id or default_run_id(cfg))


def launch(cfg: Train) -> None:
    """``train.launcher: local`` (or inside a Slurm job): run torchrun here (`detpipe.launch.torchrun.launch_local`).
    ``slurm`` (outside a Slurm job): submit `emit`'s sbatch script, stream its log to stdout, wait; cancel the job
    on SIGTERM/SIGINT.

    Raises:
        StageError: the job or a worker failed.
    """
    from detpipe.launch import slurm

    if cfg.launcher == "slurm" and "SLURM_JOB_ID" not in os.environ:
        slurm.run_job(emit(cfg, "slurm"), Path.cwd())
    else:
        launch_local(cfg, TRAIN_MODULE)


def emit(cfg: Train, kind: str) -> str:
    """The job description for a scheduler: ``slurm`` (an sbatch script, `detpipe.launch.slurm.sbatch_script`) or
    ``k8s`` (a Kubeflow PyTorchJob manifest, `detpipe.launch.k8s.pytorchjob_manifest`), for the current params."""
    from detpipe.launch import k8s, slurm

    if kind == "slurm":
        port = cfg.rdzv_endpoint.rsplit(":", 1)[1]
        return slurm.sbatch_script(cfg, launch_args(cfg, f"${{RDZV_HOST}}:{port}", "${SLURM_JOB_ID}"),
                                   launch_env(cfg), Path.cwd())
    job = k8s.job_name(cfg)
    return k8s.pytorchjob_manifest(cfg, job, launch_args(cfg, k8s.rdzv_endpoint(job, cfg), job), launch_env(cfg))


def write_job(cfg: Train, kind: str, out: Path | str | None = None) -> None:
    """`emit` ``kind``'s job description to the file ``out`` (written atomically), or to stdout when None."""
    text = emit(cfg, kind)
    if out:
        from detpipe.files import atomic_write_bytes

        atomic_write_bytes(out, text.encode())
    else:
        print(text, end="")


def check_and_launch(cfg: Train) -> None:
    """The train stage's launcher: `check_inputs`, then `launch`.

    Raises:
        StageError: as `check_inputs` and `launch`.
    """
    check_inputs(cfg)
    launch(cfg)
