"""Train stage on real COCO128 images: outputs, resume semantics, exact resume after kill -9, bad input."""
from __future__ import annotations

import csv
import datetime
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from support.pipeline import (assert_same_training_state, checkpoint_iterations, checkpoints, kill9_training_after,
                              stage_cli, stage_in_background, write_params)
from support.procs import stage_env


def test_train_outputs(trained_workdir):
    work = trained_workdir
    params = yaml.safe_load((work / "params.yaml").read_text())["train"]
    meta = json.loads((work / "data/arrow/meta.json").read_text())
    n_train = meta["splits"]["train"]["images"]
    max_iter = params["epochs"] * (n_train // params["batch_size"])
    model = torch.load(work / "models/model.pt", weights_only=True)
    assert model["iters"] == max_iter
    assert model["config"]["name"] == params["model"]
    assert model["config"]["num_classes"] == meta["num_classes"] == 81
    # keep_last checkpoints, the newest at the final iteration
    ckpts = checkpoints(work)
    assert [p.name for p in ckpts][-1] == f"ckpt-{max_iter:07d}.pt"
    assert len(ckpts) <= params["keep_last"]
    last = torch.load(ckpts[-1], weights_only=True)
    for k, v in model["model"].items():
        assert torch.equal(v, last["model"][k]), k
    # DVCLive curves: one row per iteration, finite losses
    metrics = json.loads((work / "dvclive/metrics.json").read_text())
    assert metrics["step"] == max_iter
    rows = list(csv.DictReader(open(work / "dvclive/plots/metrics/train/loss.tsv"), delimiter="\t"))
    assert [int(r["step"]) for r in rows] == list(range(1, max_iter + 1))
    assert all(float(r["loss"]) == float(r["loss"]) and float(r["loss"]) > 0 for r in rows)


def _copy(src: Path, dst: Path, overrides: dict | None = None) -> Path:
    shutil.copytree(src / "data", dst / "data")
    write_params(dst, overrides)
    return dst


_PROGRESS = re.compile(r"^(\S+ \S+) detpipe\.progress INFO train: iteration (\d+)/(\d+), epoch \d+/\d+, loss [\d.e+-]+, "
                       r"lr [\d.e+-]+, [\d.]+ images/s, ETA \d+:\d\d:\d\d$", re.M)


def _stamp(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _sigterm_when(work: Path, stderr_path: Path, ready) -> tuple[int, str]:
    """Run the train stage in ``work`` (stderr to ``stderr_path``, a file: nobody reads a pipe meanwhile), send
    SIGTERM once ``ready(stderr so far)`` holds; returns ``(exit status, stderr)``."""
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=work, env=stage_env(),
                                stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.time() + 300
        while not ready(stderr_path.read_text()):
            assert proc.poll() is None and time.time() < deadline, "training ended before it could be interrupted"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return proc.returncode, stderr_path.read_text()


@pytest.mark.slow
def test_kill9_and_sigterm_resume_is_bit_identical(cached_workdir, tmp_path):
    """kill -9 mid-training, run again, SIGTERM that run mid-training, run again: final weights and optimizer
    state equal an uninterrupted run's. The SIGTERM gives one `error:` line naming the iteration and the kept
    checkpoint, exit status 143, a checkpoint that loads; without a TTY the log has a progress line at least every
    train.log_every_s seconds (plus one step)."""
    overrides = {"train": {"epochs": 5, "checkpoint_every": 1, "keep_last": 10, "log_every_s": 1}}
    straight = _copy(cached_workdir, tmp_path / "straight", overrides)
    killed = _copy(cached_workdir, tmp_path / "killed", overrides)
    with stage_in_background("train", straight):      # the uninterrupted run, on the other core
        kill9_training_after(killed)
        interrupted_at = len(checkpoints(killed))   # its workers are gone too: no checkpoint comes after this
        # resume, then SIGTERM once two progress lines were logged and a checkpoint past the resumed one exists
        status, stderr = _sigterm_when(killed, tmp_path / "sigterm.log",
                                       lambda text: len(_PROGRESS.findall(text)) >= 2
                                       and checkpoint_iterations(killed)[-1] > interrupted_at)
    final_iter = checkpoint_iterations(straight)[-1]
    assert interrupted_at < final_iter, "the kill came too late to test anything"
    assert "resuming from" in stderr
    assert status == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    m = re.fullmatch(r"error: interrupted by SIGTERM at iteration (\d+); checkpoint (ckpt-(\d{7})\.pt) kept",
                     errors[0])
    assert m, errors[0]
    newest = checkpoints(killed)[-1]
    assert newest.name == m.group(2) and int(m.group(1)) >= int(m.group(3)) > interrupted_at
    assert torch.load(newest, weights_only=True)["iter"] == int(m.group(3)) < final_iter
    assert not list((killed / "checkpoints").glob(".ckpt-*"))  # no half-written file left
    # progress lines from the start of training on, never more than log_every_s + the slowest step apart
    start = _stamp(re.search(r"^(\S+ \S+) detpipe\.engine\.trainer INFO rank 0/1 .* iterations \d+\.\.", stderr, re.M)[1])
    lines = _PROGRESS.findall(stderr)
    assert all(total == str(final_iter) for _, _, total in lines)
    step_times = [float(r["step_time"]) for r in csv.DictReader(
        open(killed / "dvclive/plots/metrics/train/step_time.tsv"), delimiter="\t")]
    stamps = [start] + [_stamp(t) for t, _, _ in lines]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert max(gaps) <= 1 + max(step_times) + 1.0, (gaps, step_times)  # 1 s slack for a loaded machine

    resumed = stage_cli("train", killed)
    assert f"resuming from checkpoints/{m.group(2)}" in resumed.stderr

    assert assert_same_training_state(checkpoints(straight)[-1], checkpoints(killed)[-1]) == final_iter
    # the resumed run's curves have one row per iteration, no gap and no duplicate
    rows = list(csv.DictReader(open(killed / "dvclive/plots/metrics/train/loss.tsv"), delimiter="\t"))
    assert [int(r["step"]) for r in rows] == list(range(1, final_iter + 1))


def test_resume_rules(trained_workdir, tmp_path):
    work = _copy(trained_workdir, tmp_path / "w")
    shutil.copytree(trained_workdir / "checkpoints", work / "checkpoints")
    # same params: resumes at the end, nothing left to do (no extra epoch, the same model)
    before = torch.load(trained_workdir / "models/model.pt", weights_only=True)
    ckpts = [p.name for p in checkpoints(work)]
    same = stage_cli("train", work)
    assert "resuming from" in same.stderr
    after = torch.load(work / "models/model.pt", weights_only=True)
    assert [p.name for p in checkpoints(work)] == ckpts and after["iters"] == before["iters"]
    assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())
    # other params + must: a clear one-line error, exit 2
    write_params(work, {"train": {"lr": 0.02, "resume": "must"}})
    must = stage_cli("train", work, check=False)
    assert must.returncode == 2
    assert "train.resume is 'must'" in must.stderr and "Traceback" not in must.stderr
    # other params + auto: starts fresh, says why, and removes the foreign checkpoints
    write_params(work, {"train": {"lr": 0.02, "epochs": 1}})
    fresh = stage_cli("train", work)
    assert "starting fresh" in fresh.stderr and "other training params" in fresh.stderr
    assert [p.name for p in checkpoints(work)] == ["ckpt-0000002.pt"]


def test_unknown_model_is_one_line_error(cached_workdir, tmp_path):
    work = _copy(cached_workdir, tmp_path / "w", {"train": {"model": "no_such_net"}})
    proc = stage_cli("train", work, check=False)
    assert proc.returncode == 2
    err = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(err) == 1 and "unknown model 'no_such_net'" in err[0] and "train.model" in err[0]
    assert "Traceback" not in proc.stderr
    assert not (work / "models/model.pt").exists() and not (work / "checkpoints").exists()


def test_local_weights_path(trained_workdir, tmp_path):
    """train.weights: a local state_dict file initialises the model (checked by its sha256)."""
    from detpipe.files import sha256_file
    from detpipe.models import build_from_config, load_weights

    ckpt = torch.load(trained_workdir / "models/model.pt", weights_only=True)
    path = tmp_path / "w.pt"
    torch.save(ckpt["model"], path)
    model = build_from_config(ckpt["config"])
    out = load_weights(model, str(path), sha256_file(path))
    assert out["loaded"] == len(ckpt["model"]) and out["skipped"] == []
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt["model"][k])
    from detpipe.errors import StageError
    with pytest.raises(StageError, match="sha256"):
        load_weights(model, str(path), "0" * 64)

