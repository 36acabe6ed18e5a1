"""End to end: `dvc repro` of the whole default pipeline in a git copy of the repository (12 images, tiny params;
the session's ``reproduced_repo``), then a no-op repro, then a DVC experiment that shows up in `dvc exp show`
beside the baseline: one more epoch, which continues the finished run (only the added iterations train), with the
error types among its columns."""
from __future__ import annotations

import json
import math

import pytest
import torch

from support.pipeline import checkpoints
from support.procs import run
from support.repos import clone_with_cache


@pytest.mark.slow
def test_dvc_repro_end_to_end(reproduced_repo, tmp_path):
    work = reproduced_repo
    for path in ("data/raw/annotations/instances_train2017.json", "data/arrow/meta.json", "data/arrow/report.json",
                 "data/cache/meta.json", "models/model.pt", "models/torch_export/model.pt2", "models/model.onnx",
                 "models/export_report.json", "dvclive/metrics.json", "plots/pr_curve.json"):
        assert (work / path).is_file(), path
    assert list((work / "data/arrow/train").glob("*.arrow")) and list((work / "data/cache/val").glob("*.arrow"))
    assert checkpoints(work)
    metrics = json.loads((work / "metrics/eval.json").read_text())
    assert len(metrics["bbox"]) == 12 and all(math.isfinite(v) for v in metrics["bbox"].values())
    report = json.loads((work / "models/export_report.json").read_text())
    assert set(report["formats"]) == {"torch_export", "onnx"} and all(r["raw"]["ok"] for r in report["formats"].values())

    work = clone_with_cache(reproduced_repo, tmp_path / "repo")       # experiments change the repository
    again = run(["dvc", "repro"], work)
    assert "Data and pipelines are up to date." in again.stdout + again.stderr

    # "give it one more epoch": the finished 1-epoch run is continued (issue 35), not trained again from iteration 0
    first_iters = torch.load(work / "models/model.pt", weights_only=True)["iters"]
    first_rows = (work / "dvclive/plots/metrics/train/loss.tsv").read_text().splitlines()
    samples = tmp_path / "samples"
    samples.mkdir()
    exp = run(["dvc", "exp", "run", "-S", "train.epochs=2", "-S", "export.torch_export=false", "--name", "two-epochs"],
              work, env={"DETPIPE_SAMPLE_LOG": str(samples)})  # ONNX only: torch.export was proven by the repro above
    log = exp.stdout + exp.stderr
    assert (f"continuing the training of checkpoint iteration {first_iters} with another schedule (epochs 1 -> 2)"
            in log), log[-4000:]
    trained = sorted({json.loads(line)["iter"] for f in samples.glob("*.jsonl") for line in f.read_text().splitlines()})
    assert trained == list(range(first_iters, 2 * first_iters))            # only the added iterations ran
    assert torch.load(work / "models/model.pt", weights_only=True)["iters"] == 2 * first_iters
    rows = (work / "dvclive/plots/metrics/train/loss.tsv").read_text().splitlines()
    assert rows[:len(first_rows)] == first_rows and len(rows) == 1 + 2 * first_iters   # the curve goes on
    show = json.loads(run(["dvc", "exp", "show", "--json"], work).stdout)
    runs = {}
    for commit in show:
        for exp in [commit] + [e for x in commit.get("experiments") or [] for e in x.get("revs", [])]:
            data = (exp.get("data") or {})
            p = data.get("params", {}).get("params.yaml", {}).get("data", {})
            m = data.get("metrics", {}).get("metrics/eval.json", {}).get("data", {})
            if p:
                runs[exp.get("name") or exp.get("rev")] = (p["train"]["epochs"], m.get("bbox", {}).get("AP"),
                                                           sorted(m.get("errors", {})))
    assert runs.get("two-epochs", (None,))[0] == 2, runs
    assert any(epochs == 1 and ap is not None for epochs, ap, _ in runs.values()), runs
    # the error types (issue 33) are experiment columns
    assert {"cls", "loc", "both", "dupe", "bkg", "miss"} <= set(runs["two-epochs"][2]), runs
