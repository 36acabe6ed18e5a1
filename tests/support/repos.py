"""Git + DVC repository copies for tests: the committed tree with a 12-image dataset, tiny params."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from support.pipeline import make_coco_subset, set_params, write_params
from support.procs import REPO, run


def copy_repo(dest: Path, n_images: int = 12) -> Path:
    """The committed tree (as `git ls-files` lists it, current contents), with the embedded dataset cut to
    ``n_images`` images, in a fresh git repository."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if rel.startswith("data/coco128/"):
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / rel).exists():
            shutil.copy2(REPO / rel, dest / rel)
    make_coco_subset(dest / "data" / "coco128", n_images)
    run(["git", "init", "-q", "-b", "main"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "copy"], dest)
    return dest


def make_repo(dest: Path, train: dict | None = None, export: dict | None = None) -> Path:
    """A git copy of the repository with 12 images and tiny params (committed), pinned by the subset's sha256,
    ``train`` and ``export`` params updated; export writes ONNX only unless ``export`` says otherwise
    (``export.torch_export: false``: torch.export is most of the stage's time, and tests/stages/test_export.py and
    the ``reproduced_repo`` fixture check it)."""
    from detpipe.core.files import folder_sha256

    work = copy_repo(dest)
    write_params(work, {"download": {"sha256": folder_sha256(work / "data" / "coco128")}, "train": train or {},
                        "export": {"torch_export": False, **(export or {})}})
    run(["git", "commit", "-qam", "tiny params"], work)
    return work


def clone_with_cache(src: Path, dest: Path) -> Path:
    """A copy of repository ``src`` (git, workspace and DVC cache; the cache's files hard-linked, as DVC
    treats them read-only) at ``dest``: starts where ``src`` is without recomputing any stage."""
    def link_or_copy(a: str, b: str) -> None:
        if "/.dvc/cache/" in a:
            os.link(a, b)
        else:
            shutil.copy2(a, b)
    shutil.copytree(src, dest, symlinks=True, copy_function=link_or_copy)
    return dest


def flow_repo(reproduced_repo: Path, dest: Path, train: dict | None = None) -> Path:
    """A copy of the session's reproduced repository (its DVC cache holds every stage's outputs) with ``train``
    params and an ONNX-only export (``export.torch_export: false``: torch.export is most of the stage's time, and
    tests/stages/test_export.py checks it), committed: a run of it skips download, convert and augment."""
    work = clone_with_cache(reproduced_repo, dest)
    set_params(work, {"train": train or {}, "export": {"torch_export": False}})
    run(["git", "commit", "-qam", "flow test params"], work)
    return work


def snapshot(repo: Path) -> dict[str, str]:
    """sha256 of every file of the user's workspace (``.git``, ``.dvc/cache`` and ``.dvc/tmp`` left out)."""
    out = {}
    for path in sorted(repo.rglob("*")):
        rel = path.relative_to(repo).as_posix()
        if path.is_file() and not rel.startswith((".git/", ".dvc/cache/", ".dvc/tmp/")):
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
