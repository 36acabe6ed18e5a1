"""train.weights: exp:<name> (a DVC experiment, branch or tag's models/model.pt, pinned by train.weights_sha256)
and checkpoint:best / checkpoint:last (issue 35.3)."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys

import pytest
import torch

from support.pipeline import checkpoints, set_params, stage_cli
from support.repos import clone_with_cache
from detpipe.core.errors import StageError
from detpipe.models import build_from_config, load_weights
from detpipe.warm_start import materialise_weights


def _same_tensors(model, state):
    own = model.state_dict()
    assert set(state) <= set(own)
    for k, v in state.items():
        assert torch.equal(own[k], v), k


def test_exp_weights_from_a_tag_are_pinned_and_loaded(reproduced_repo, tmp_path):
    repo = clone_with_cache(reproduced_repo, tmp_path / "repo")
    subprocess.run(["git", "tag", "run1"], cwd=repo, check=True)
    data = (repo / "models/model.pt").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (repo / "models/model.pt").unlink()  # read from the DVC cache at the tag, not the workspace
    dest = materialise_weights("exp:run1", digest, tmp_path / "start.pt", repo / "checkpoints", repo=str(repo))
    assert dest.read_bytes() == data
    ckpt = torch.load(dest, weights_only=True)
    model = build_from_config(ckpt["config"])
    out = load_weights(model, str(dest))
    assert not out["skipped"]
    _same_tensors(model, ckpt["model"])
    # the pin is required and checked; a bad name is one line naming the setting
    with pytest.raises(StageError, match=r"train.weights.*needs train.weights_sha256.*sha256 " + digest):
        materialise_weights("exp:run1", None, tmp_path / "x.pt", repo / "checkpoints", repo=str(repo))
    with pytest.raises(StageError, match=r"train.weights.*has sha256 .*weights_sha256 says"):
        materialise_weights("exp:run1", "0" * 64, tmp_path / "x.pt", repo / "checkpoints", repo=str(repo))
    with pytest.raises(StageError, match=r"train.weights.*'no-such-exp'") as e:
        materialise_weights("exp:no-such-exp", digest, tmp_path / "x.pt", repo / "checkpoints", repo=str(repo))
    assert "\n" not in str(e.value)


def test_checkpoint_last_and_best(trained_workdir, tmp_path):
    ckpt_dir = trained_workdir / "checkpoints"
    last = checkpoints(trained_workdir)[-1]
    dest = materialise_weights("checkpoint:last", None, tmp_path / "start.pt", ckpt_dir)
    assert dest.read_bytes() == last.read_bytes()
    state = torch.load(dest, weights_only=True)
    model = build_from_config(state["config"]) if "config" in state else None
    if model is not None:
        load_weights(model, str(dest))
        _same_tensors(model, state["model"])
    # trained without train.eval_every: no best.pt (checkpoint:best from a real best.pt: tests/stages/test_train.py's
    # test_patience_stops_every_rank_at_one_iteration_and_a_resume_keeps_counting)
    assert not (ckpt_dir / "best.pt").exists()
    with pytest.raises(StageError, match=r"'checkpoint:best' but .*best.pt does not exist"):
        materialise_weights("checkpoint:best", None, tmp_path / "best.pt", ckpt_dir)
    with pytest.raises(StageError, match=r"checkpoint:last.*holds no ckpt"):
        materialise_weights("checkpoint:last", None, tmp_path / "x.pt", tmp_path / "empty")
    with pytest.raises(StageError, match=r"expected exp:<name>, checkpoint:best or checkpoint:last"):
        materialise_weights("checkpoint:first", None, tmp_path / "x.pt", ckpt_dir)


def test_launcher_fails_on_a_missing_best_checkpoint(trained_workdir, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(trained_workdir, work, symlinks=True)
    (work / "checkpoints/best.pt").unlink(missing_ok=True)
    set_params(work, {"train": {"weights": "checkpoint:best"}})
    r = stage_cli("train", work, check=False, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    lines = [ln for ln in out.splitlines() if "checkpoint:best" in ln]
    assert lines and "train.weights" in lines[-1] and "best.pt does not exist" in lines[-1]
    assert not (work / "checkpoints/warm_start.pt").exists()


def test_other_classes_reinitialise_the_head_with_the_reason_logged(trained_workdir, caplog):
    ckpt = torch.load(trained_workdir / "models/model.pt", weights_only=True)
    config = dict(ckpt["config"], num_classes=ckpt["config"]["num_classes"] + 2)
    model = build_from_config(config)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level("INFO", logger="detpipe.models"):
        out = load_weights(model, str(trained_workdir / "models/model.pt"))
    assert f"trained for {ckpt['config']['num_classes']} classes" in caplog.text and "re-initialised" in caplog.text
    assert out["skipped"] and all("classification_head" in k for k in out["skipped"])
    for k in out["skipped"]:
        assert torch.equal(model.state_dict()[k], fresh[k])


def test_exp_weights_from_the_remote_only_and_the_launchers_error_line(reproduced_repo, tmp_path):
    repo = clone_with_cache(reproduced_repo, tmp_path / "repo")
    data = (repo / "models/model.pt").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    dvc = [sys.executable, "-m", "dvc"]
    subprocess.run(dvc + ["remote", "add", "-d", "store", str(tmp_path / "remote")], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "remote", "--", ".dvc/config"], cwd=repo, check=True)
    subprocess.run(["git", "tag", "run1"], cwd=repo, check=True)  # the tag's config names the remote
    subprocess.run(dvc + ["push", "-q", "models/model.pt"], cwd=repo, check=True, capture_output=True)
    shutil.rmtree(repo / ".dvc/cache")  # hard links: the fixture's cache is untouched
    (repo / "models/model.pt").unlink()
    dest = materialise_weights("exp:run1", digest, tmp_path / "start.pt", repo / "checkpoints", repo=str(repo))
    assert dest.read_bytes() == data
    # through the launcher: one line naming the setting, exit status 2, before any worker starts
    set_params(repo, {"train": {"weights": "exp:no-such-exp", "weights_sha256": digest}})
    r = stage_cli("train", repo, check=False, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    line = [ln for ln in out.splitlines() if "no-such-exp" in ln]
    assert line and "train.weights" in line[-1] and "rank" not in out.lower().split("no-such-exp")[0][-200:]


def test_build_trainer_starts_from_checkpoint_last_before_a_fresh_start_deletes_it(trained_workdir, tmp_path,
                                                                                    request):
    import random

    import numpy as np

    from detpipe import params as params_mod
    from detpipe.engine.checkpoints import find_resume_state
    from detpipe.engine.trainer import build_trainer

    work = tmp_path / "w"
    shutil.copytree(trained_workdir, work, symlinks=True)
    threads, rngs = torch.get_num_threads(), (random.getstate(), np.random.get_state(), torch.get_rng_state())
    request.addfinalizer(lambda: (torch.set_num_threads(threads), random.setstate(rngs[0]),
                                  np.random.set_state(rngs[1]), torch.set_rng_state(rngs[2])))
    last = torch.load(checkpoints(work)[-1], weights_only=True)
    cfg = params_mod.load("train", work / "params.yaml").model_copy(update={"weights": "checkpoint:last",
                                                                            "resume": "restart"})
    trainer = build_trainer(cfg, work / "data/cache", work / "data/arrow/meta.json", work / "checkpoints",
                            str(tmp_path / "dl"))
    # a fresh start (weights changed the fingerprint) deletes the old checkpoints; the copy stays
    assert find_resume_state(cfg.resume, trainer.fingerprint, work / "checkpoints") is None
    assert not checkpoints(work) and (work / "checkpoints/warm_start.pt").is_file()
    assert all(torch.equal(v, last["model"][k]) for k, v in trainer.module.state_dict().items())
