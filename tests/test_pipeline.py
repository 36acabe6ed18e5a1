"""End to end: `dvc repro` in a temporary copy of the repository with tiny params, then a no-op repro, then a
DVC experiment that shows up in `dvc exp show` beside the baseline."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, make_coco_subset, stage_env, write_params


def sh(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**stage_env(), "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


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
    sh(["git", "init", "-q", "-b", "main"], dest)
    sh(["git", "add", "-A"], dest)
    sh(["git", "commit", "-qm", "copy"], dest)
    return dest


@pytest.mark.slow
def test_dvc_repro_end_to_end(tmp_path):
    work = copy_repo(tmp_path / "repo")
    write_params(work, {"train": {"epochs": 1}, "download": {"sha256": None}})  # a 12-image subset
    sh(["git", "commit", "-qam", "tiny params"], work)
    sh(["dvc", "repro"], work)
    for path in ("data/raw/annotations/instances_train2017.json", "data/arrow/meta.json", "data/arrow/report.json",
                 "data/cache/meta.json", "models/model.pt", "models/torch_export/model.pt2", "models/model.onnx",
                 "models/export_report.json", "dvclive/metrics.json", "plots/pr_curve.json"):
        assert (work / path).is_file(), path
    assert list((work / "data/arrow/train").glob("*.arrow")) and list((work / "data/cache/val").glob("*.arrow"))
    assert list((work / "checkpoints").glob("ckpt-*.pt"))
    metrics = json.loads((work / "metrics/eval.json").read_text())
    assert len(metrics["bbox"]) == 12 and all(math.isfinite(v) for v in metrics["bbox"].values())

    again = sh(["dvc", "repro"], work)
    assert "Data and pipelines are up to date." in again.stdout + again.stderr

    sh(["git", "add", "-A"], work)
    sh(["git", "commit", "-qm", "baseline run"], work)
    sh(["dvc", "exp", "run", "-S", "train.epochs=2", "--name", "two-epochs"], work)
    show = json.loads(sh(["dvc", "exp", "show", "--json"], work).stdout)
    runs = {}
    for commit in show:
        for exp in [commit] + [e for x in commit.get("experiments") or [] for e in x.get("revs", [])]:
            data = (exp.get("data") or {})
            p = data.get("params", {}).get("params.yaml", {}).get("data", {})
            m = data.get("metrics", {}).get("metrics/eval.json", {}).get("data", {})
            if p:
                runs[exp.get("name") or exp.get("rev")] = (p["train"]["epochs"], m.get("bbox", {}).get("AP"))
    assert runs.get("two-epochs", (None,))[0] == 2, runs
    assert any(epochs == 1 and ap is not None for epochs, ap in runs.values()), runs
