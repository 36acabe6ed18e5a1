"""End to end: `dvc repro` of the whole default pipeline in a git copy of the repository (12 images, tiny params;
the session's ``reproduced_repo``), then a no-op repro, then a DVC experiment that shows up in `dvc exp show`
beside the baseline: one more epoch, which continues the finished run (only the added iterations train), with the
error types among its columns; then an experiment warm-started from that one's model (``train.weights:
exp:<name>``, pinned in dvc.lock) that stops early (``train.patience``), both visible in `dvc exp show`."""
from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
import yaml

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
    # warm start from that experiment's model (exp:<name>, pinned by its sha256) and early stopping: val AP
    # evaluated every iteration can never gain min_delta=1, so the second evaluation is the patience=1'th stale one
    pinned = hashlib.sha256((work / "models/model.pt").read_bytes()).hexdigest()     # two-epochs' model
    exp = run(["dvc", "exp", "run", "-S", "train.weights=exp:two-epochs", "-S", f"train.weights_sha256={pinned}",
               "-S", "train.eval_every=1", "-S", "train.patience=1", "-S", "train.min_delta=1.0",
               "--name", "warm-early"], work)
    log = exp.stdout + exp.stderr
    assert f"train.weights exp:two-epochs (sha256 {pinned}) copied to checkpoints/warm_start.pt" in log, log[-4000:]
    assert 2 < 2 * first_iters and "stopped early at iteration 2:" in log, log[-4000:]
    assert torch.load(work / "models/model.pt", weights_only=True)["iters"] == 2
    locked = yaml.safe_load((work / "dvc.lock").read_text())["stages"]["train"]["params"]["params.yaml"]
    assert locked["train"]["weights"] == "exp:two-epochs" and locked["train"]["weights_sha256"] == pinned

    show = json.loads(run(["dvc", "exp", "show", "--json"], work).stdout)
    runs = {}
    for commit in show:
        for exp in [commit] + [e for x in commit.get("experiments") or [] for e in x.get("revs", [])]:
            data = (exp.get("data") or {})
            p = data.get("params", {}).get("params.yaml", {}).get("data", {})
            m = data.get("metrics", {}).get("metrics/eval.json", {}).get("data", {})
            live = data.get("metrics", {}).get("dvclive/metrics.json", {}).get("data", {})
            if p:
                runs[exp.get("name") or exp.get("rev")] = (p["train"]["epochs"], m.get("bbox", {}).get("AP"),
                                                           sorted(m.get("errors", {})), p["train"]["weights"],
                                                           live.get("train", {}).get("stopped_early_at"))
    assert runs.get("two-epochs", (None,))[0] == 2, runs
    assert any(epochs == 1 and ap is not None for epochs, ap, *_ in runs.values()), runs
    # the error types (issue 33) are experiment columns
    assert {"cls", "loc", "both", "dupe", "bkg", "miss"} <= set(runs["two-epochs"][2]), runs
    # the warm start and the early stop are experiment columns too (issue 35)
    assert runs["warm-early"][3:] == ("exp:two-epochs", 2) and runs["two-epochs"][3:] == (None, None), runs
    print(run(["dvc", "exp", "show", "--drop", ".*", "--keep",
               r"Experiment|train\.(epochs|weights|patience)$|.*stopped_early_at|bbox\.AP$"], work).stdout)
