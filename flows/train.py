"""Prefect flow ``train``: runs the DVC pipeline stage by stage, so ``dvc repro`` and Prefect share one cache.

Each stage is a Prefect task running ``dvc repro <stage>`` (Prefect's own task caching is off: DVC decides what
is up to date). With parameter overrides the flow runs ``dvc exp run -S key=value ... --name <flow run name>``
instead, so the run appears in ``dvc exp show`` with its params and metrics.

Run once: ``python -m flows.train`` (or with ``--param train.lr=0.01``); serve as deployment ``train/main``:
``python -m flows.serve``, then ``prefect deployment run train/main``.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

STAGES = ("download", "convert", "augment", "train", "evaluate", "export")
REPO = Path(__file__).resolve().parent.parent


def run_logged(cmd: list[str]) -> None:
    """Run ``cmd`` in the repository root, streaming its output lines into the Prefect run log.

    Raises:
        RuntimeError: non-zero exit status (the message quotes the command and its last output line).
    """
    logger = get_run_logger()
    logger.info("$ %s", " ".join(cmd))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    last = ""
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            last = line
            logger.info(line)
    if proc.wait():
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}: {last}")


@task(name="dvc-stage", cache_policy=None, task_run_name="{stage}")
def run_stage(stage: str) -> None:
    """Reproduce one DVC stage (a no-op when DVC finds it up to date)."""
    run_logged(["dvc", "repro", stage])


@task(name="dvc-experiment", cache_policy=None, task_run_name="exp-{name}")
def run_experiment(overrides: dict[str, object], name: str) -> None:
    """Run the whole pipeline as DVC experiment ``name`` with ``-S key=value`` overrides."""
    cmd = ["dvc", "exp", "run", "--name", name]
    for key, value in overrides.items():
        cmd += ["-S", f"{key}={value}"]
    run_logged(cmd)


@flow(name="train", log_prints=True)
def train(params: dict[str, object] | None = None) -> dict:
    """Run download → convert → augment → train → evaluate → export through DVC.

    Args:
        params: overrides such as ``{"train.lr": 0.01}``; when given, the run is a DVC experiment named
            after the flow run.
    Returns:
        paths of the metrics and exported models.
    """
    if params:
        name = re.sub(r"[^A-Za-z0-9_-]", "-", flow_run.get_name() or "prefect-run")
        run_experiment(dict(params), name)
    else:
        for stage in STAGES:
            run_stage(stage)
    return {"metrics": str(REPO / "metrics/eval.json"), "torchscript": str(REPO / "models/model.ts"),
            "onnx": str(REPO / "models/model.onnx")}


def _parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            sys.exit(f"error: --param expects key=value, got '{item}'")
        out[key] = value
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--param", action="append", default=[], help="override, e.g. train.lr=0.01")
    args = parser.parse_args()
    train(_parse_overrides(args.param) or None)
