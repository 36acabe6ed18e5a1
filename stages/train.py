"""Train stage: a torchvision detector trained with DDP from the augmentation cache, resumable at any point.

``python -m stages.train`` (the DVC stage command) checks params and inputs, then launches
``torchrun --rdzv-backend c10d ... -m stages.train`` (`detpipe.launch.torchrun`; under Slurm with ``train.launcher:
slurm``); each worker (detected by torchrun's ``LOCAL_RANK`` variable) trains with DDP — gloo on CPU, nccl on
CUDA. A worker binds itself to its launcher as it starts, before it imports torch: the kernel kills it when
the launcher dies, at once if the launcher died before (`detpipe.lifeline.die_with_launcher`), so a ``kill -9``
of the stage never leaves workers training on beside the next run. ``python -m stages.train --emit slurm|k8s``
writes the Slurm script / Kubernetes manifest instead (README "Multi-node").

Outputs: ``checkpoints/ckpt-NNNNNNN.pt`` (kept across runs: ``persist: true`` in dvc.yaml), ``models/model.pt``
(``{"model": state_dict, "config": {...}}`` for the evaluate and export stages), ``dvclive/`` (training
curves). A checkpoint holds model, optimizer, grad scaler, every hook's state, the iteration (hence the
sampler's position in its epoch) and every rank's RNG states, plus a fingerprint of the params and data
that produced it: ``train.resume: auto`` resumes from the newest checkpoint with the same fingerprint and
otherwise starts fresh, saying why; ``never`` always starts fresh; ``must`` stops with an error when there
is nothing to resume.

The work itself is `detpipe.engine.trainer.train`. Without a terminal, a progress line (iteration/total, epoch, loss, lr,
images/s, ETA) is logged every ``train.log_every_s`` seconds. SIGTERM or SIGINT stops training with one line
``error: interrupted by SIGTERM at iteration N; checkpoint ckpt-NNNNNNN.pt kept`` and exit status 128 + signal;
that checkpoint is complete (written atomically) and the next run resumes from it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from detpipe.errors import StageError, run_stage
from detpipe.launch.torchrun import default_run_id, launch_env, launch_local, torchrun_args
from detpipe.lifeline import die_with_launcher

if TYPE_CHECKING:
    from detpipe.params import Train

# Only light modules above (standard library only); the heavy ones (torch, pydantic, pyarrow) are imported
# where used, so that a worker is bound to its launcher before it imports them (`main`).


def check_inputs(cfg: Train) -> None:
    """Fail fast, before launching workers, on problems every worker would hit (one-line StageError): missing
    inputs, unknown model, a mask model on a cache without masks, a weights file that does not exist."""
    from detpipe.engine.trainer import build_detector

    build_detector(cfg)
    if cfg.weights and "://" not in cfg.weights and not Path(cfg.weights).exists() and \
            ("/" in cfg.weights or cfg.weights.endswith((".pt", ".pth"))):
        raise StageError(f"params.yaml: key 'train.weights': file '{cfg.weights}' not found")


def launch_args(cfg: Train, endpoint: str | None = None, run_id: str | None = None) -> list[str]:
    """torchrun arguments of this stage (see `detpipe.launch.torchrun.torchrun_args`): c10d rendezvous at ``endpoint``
    (default ``train.rdzv_endpoint``) under job id ``run_id`` (default `detpipe.launch.torchrun.default_run_id`)."""
    return torchrun_args(cfg, "stages.train", endpoint or cfg.rdzv_endpoint, run_id or default_run_id(cfg))


def launch(cfg: Train) -> None:
    """``train.launcher: local``: run torchrun here (`detpipe.launch.torchrun.launch_local`). ``slurm`` (outside a Slurm
    job): submit `emit`'s sbatch script, stream its log to stdout, wait; cancel the job on SIGTERM/SIGINT.
    Raises `StageError` when the job fails."""
    from detpipe.launch import slurm

    if cfg.launcher == "slurm" and "SLURM_JOB_ID" not in os.environ:
        slurm.run_job(emit(cfg, "slurm"), Path.cwd())
    else:
        launch_local(cfg, "stages.train")


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


def main(argv: list[str] | None = None) -> None:
    """Worker (under torchrun): first bind to the launcher (`detpipe.lifeline.die_with_launcher`), then train.
    Otherwise check inputs and launch (``train.launcher``), or with ``--emit slurm|k8s [--out FILE]`` only
    write the job description for the current params."""
    worker = "LOCAL_RANK" in os.environ
    if worker:
        die_with_launcher()
    import argparse

    from detpipe import params as params_mod

    ap = argparse.ArgumentParser(prog="python -m stages.train", description=__doc__.splitlines()[0])
    ap.add_argument("--emit", choices=["slurm", "k8s"], help="write the Slurm sbatch script or Kubernetes manifest")
    ap.add_argument("--out", type=Path, help="file to write (default: stdout)")
    args = ap.parse_args(argv)
    cfg = params_mod.load("train")
    if worker:
        from detpipe.engine.trainer import train

        train(cfg)
    elif args.emit:
        from detpipe.files import atomic_write_bytes

        text = emit(cfg, args.emit)
        if args.out:
            atomic_write_bytes(args.out, text.encode())
        else:
            print(text, end="")
    else:
        check_inputs(cfg)
        launch(cfg)


if __name__ == "__main__":
    run_stage(main)
