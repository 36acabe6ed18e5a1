"""``python -m detpipe.launch.emit slurm|k8s [--out FILE]``: the train stage's job description for a scheduler, for
the current params.yaml: the Slurm sbatch script (`detpipe.launch.jobs.slurm_job`) or a Kubeflow PyTorchJob manifest
(`detpipe.launch.k8s.pytorchjob_manifest`), docs/multi-node.md.

A command of its own, outside the train stage's imports (``stages.train`` never imports this module or
`detpipe.launch.k8s`): editing the manifest code does not invalidate trained models (dvc.yaml's train deps).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from detpipe.core.errors import run_program
from detpipe.launch.jobs import launch_args, slurm_job
from detpipe.launch.torchrun_args import launch_env
from detpipe.params import Train, load


def emit(cfg: Train, kind: str) -> str:
    """The job description ``kind`` (``"slurm"``: an sbatch script; ``"k8s"``: a Kubeflow PyTorchJob manifest, YAML)
    for the train params ``cfg``.

    Raises:
        StageError: params the scheduler's job cannot run (e.g. `detpipe.launch.k8s.pytorchjob_manifest`'s refusals).
    """
    from detpipe.launch import k8s

    if kind == "slurm":
        return slurm_job(cfg)
    job = k8s.job_name(cfg)
    return k8s.pytorchjob_manifest(cfg, job, launch_args(cfg, k8s.rdzv_endpoint(job, cfg), job), launch_env(cfg))


def write_job(cfg: Train, kind: str, out: Path | str | None = None) -> None:
    """`emit` ``kind``'s job description to the file ``out`` (written atomically), or to stdout when None."""
    text = emit(cfg, kind)
    if out:
        from detpipe.core.files import atomic_write_bytes

        atomic_write_bytes(out, text.encode())
    else:
        print(text, end="")


def main(argv: list[str] | None = None) -> None:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m detpipe.launch.emit", description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["slurm", "k8s"], help="the Slurm sbatch script or the Kubernetes manifest")
    ap.add_argument("--out", type=Path, help="file to write (default: stdout)")
    args = ap.parse_args(argv)
    write_job(load("train"), args.kind, args.out)


if __name__ == "__main__":
    run_program(main, stage="train")
