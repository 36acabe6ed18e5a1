"""Shared by the benchmarks: a temporary working directory with the real convert + augment outputs for
COCO128 (or a subset), built by running the stages' own CLIs."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import yaml

REPO = Path(__file__).resolve().parent.parent


def cached_workdir(n_images: int = 128, train_overrides: dict | None = None,
                   categories: list[str] | None = None) -> Path:
    """Make ``<tmp>/data/raw`` from the first ``n_images`` COCO128 images, write ``params.yaml`` (the
    repository's, with ``train_overrides``), run convert and augment there; return the directory. ``categories``
    (COCO names, e.g. ``["person"]``): keep only those categories' annotations (every image stays, the others as
    negatives)."""
    work = Path(tempfile.mkdtemp(prefix="detpipe-bench-"))
    src = REPO / "data" / "coco128"
    ann = json.loads((src / "annotations" / "instances_train2017.json").read_text())
    images = sorted(ann["images"], key=lambda im: im["id"])[:n_images]
    ids = {im["id"] for im in images}
    raw = work / "data" / "raw"
    (raw / "annotations").mkdir(parents=True)
    (raw / "train2017").mkdir()
    cats = ann["categories"] if categories is None else [c for c in ann["categories"] if c["name"] in categories]
    if categories is not None and len(cats) != len(set(categories)):
        raise SystemExit(f"unknown category in {categories} (COCO names: {[c['name'] for c in ann['categories']]})")
    keep = {c["id"] for c in cats}
    ann = {**ann, "images": images, "categories": cats,
           "annotations": [a for a in ann["annotations"] if a["image_id"] in ids and a["category_id"] in keep]}
    (raw / "annotations" / "instances_train2017.json").write_text(json.dumps(ann))
    for im in images:
        shutil.copyfile(src / "train2017" / im["file_name"], raw / "train2017" / im["file_name"])
    write_params(work, train_overrides or {})
    for stage in ("convert", "augment"):
        subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=work, env=env(), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return work


@contextlib.contextmanager
def temporary_workdir(n_images: int = 128, train_overrides: dict | None = None, keep: bool = False,
                      categories: list[str] | None = None) -> Iterator[Path]:
    """`cached_workdir`, removed on exit; with ``keep`` left in place and its path printed to stderr (a
    benchmark's ``--keep``)."""
    work = cached_workdir(n_images, train_overrides, categories)
    try:
        yield work
    finally:
        if keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def write_params(work: Path, train_overrides: dict) -> None:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"].update(train_overrides)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def add_model_args(ap, root: Path) -> None:
    """The arguments of the benchmarks that serve or run one exported model of a pipeline run: ``--workdir`` (the
    folder with models/ and data/, default ``root``), ``--model`` (relative to it) and ``--source`` (the images)."""
    ap.add_argument("--workdir", type=Path, default=root, help="folder with models/ and data/ of a pipeline run")
    ap.add_argument("--model", default="models/model.onnx", help="relative to --workdir")
    ap.add_argument("--source", default=str(root / "data" / "coco128" / "train2017"))
