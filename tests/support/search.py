"""A git + DVC repository of the learns data (`support.pipeline.make_learns_workdir`: 4 COCO128 images, val = the
same images) for search tests: download, convert and augment already reproduced and committed, so a trial runs
train, evaluate and export only."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from support.pipeline import make_learns_workdir, set_params
from support.procs import run, stage_env
from support.repos import copy_repo

# A trial's training on the learns data: iterations (one per epoch: batch = the 4 images), evaluated and
# checkpointed every `SEARCH_EVAL_EVERY` (the pruner's report points and the resume points).
SEARCH_ITERATIONS = 24
SEARCH_EVAL_EVERY = 6


def learns_repo(dest: Path, train: dict | None = None, search: dict | None = None) -> Path:
    """A committed git + DVC repository at ``dest`` whose dataset (``data/coco128``) is the learns data, with the
    learns params (one thread, `SEARCH_ITERATIONS` iterations, evaluated and checkpointed every
    `SEARCH_EVAL_EVERY`), export ONNX only, ``train`` and ``search`` merged in; ``dvc repro augment`` done and
    committed."""
    from detpipe.core.files import folder_sha256

    repo = copy_repo(dest, n_images=1)
    work = dest.parent / (dest.name + "-learns")
    work.mkdir()
    make_learns_workdir(work)
    shutil.rmtree(repo / "data" / "coco128")
    shutil.copytree(work / "data" / "raw", repo / "data" / "coco128")
    shutil.copy2(work / "params.yaml", repo / "params.yaml")
    shutil.rmtree(work)
    set_params(repo, {"download": {"source": "data/coco128", "sha256": folder_sha256(repo / "data" / "coco128")},
                      "train": {"epochs": SEARCH_ITERATIONS, "eval_every": SEARCH_EVAL_EVERY,
                                "checkpoint_every": SEARCH_EVAL_EVERY, "log_every": 1, **(train or {})},
                      "evaluate": {"num_plot_images": 1}, "export": {"torch_export": False},
                      "search": search or {}})
    subprocess.run(["dvc", "repro", "augment"], cwd=repo, env=stage_env(), check=True, capture_output=True,
                   timeout=900)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "learns data, augment reproduced"], repo)
    return repo
