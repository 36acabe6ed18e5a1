"""Hyperparameter search (docs/search.md) on the learns data (4 COCO128 images, val = the same images):

* the pruning test: the real train stage, a trial of a study whose one finished trial (lr 0.05, trained by the same
  stage, reporting its val AP50) sets the median; a hopeless lr (1e-5) is pruned at its first evaluation and every
  rank stops there, with its checkpoint and ``search.pruned_at`` in its metrics. Its must-fail variant runs the same
  with the report switched off (``DETPIPE_SEARCH_REPORT=0``): nothing is pruned and the test fails (strict xfail).
* the search test: ``python -m flows.search`` (Prefect, a real server) on a git + DVC repository of the learns data,
  two trials (enqueued lrs 0.05 and 1e-5), SIGKILLed while trial 0 trains; the second search resumes trial 0 from
  its checkpoint in its kept workspace, does not run it again from scratch, prunes trial 1, and ``dvc exp show``
  lists both trials with their lr, AP50 and pruned state; ``dvc exp apply <best>`` brings the best model.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from support.pipeline import checkpoint_iterations, set_params, stage_cli
from support.procs import stage_env

ITERATIONS, EVERY = 12, 4   # a trial's training: iterations, evaluated (and checkpointed) every EVERY


def _spec(storage, number: int) -> dict:
    return {"storage": str(storage), "study": "prune", "number": number, "objective": "AP50", "pruner": "median",
            "startup_trials": 1}


def _trial_workdir(learns_prepared, dest, lr: float):
    work = dest / "w"
    shutil.copytree(learns_prepared, work)
    set_params(work, {"train": {"epochs": ITERATIONS, "eval_every": EVERY, "checkpoint_every": EVERY, "lr": lr,
                                "log_every": 1}})
    return work


@pytest.fixture(scope="module")
def reference_study(learns_prepared, tmp_path_factory):
    """A journal-file study with trial 0 (lr 0.05) trained by the train stage, which reported its val AP50 at
    iterations 4, 8, 12; told COMPLETE with its last one. Returns the journal's path."""
    import optuna

    from detpipe.study import open_storage, write_trial_file

    base = tmp_path_factory.mktemp("search_reference")
    storage = base / "study.journal"
    study = optuna.create_study(study_name="prune", storage=open_storage(str(storage)), direction="maximize")
    work = _trial_workdir(learns_prepared, base, 0.05)
    write_trial_file(work, _spec(storage, study.ask().number))
    stage_cli("train", work)
    reported = study.trials[0].intermediate_values
    assert sorted(reported) == [4, 8, 12], reported
    study.tell(0, reported[12])
    return storage


@pytest.mark.slow
@pytest.mark.parametrize("report", [True, pytest.param(False, marks=pytest.mark.xfail(
    strict=True, reason="must fail: the pruner's report is switched off, so nothing is pruned"))])
def test_a_hopeless_trial_is_pruned_at_its_first_evaluation(reference_study, learns_prepared, tmp_path, report):
    import optuna

    from detpipe.study import REPORT_ENV, open_storage, write_trial_file

    storage = tmp_path / "study.journal"
    shutil.copyfile(reference_study, storage)
    study = optuna.load_study(study_name="prune", storage=open_storage(str(storage)))
    work = _trial_workdir(learns_prepared, tmp_path, 1e-5)
    write_trial_file(work, _spec(storage, study.ask().number))
    proc = stage_cli("train", work, env={REPORT_ENV: "1" if report else "0"})
    trial = optuna.load_study(study_name="prune", storage=open_storage(str(storage))).trials[1]
    live = json.loads((work / "dvclive" / "metrics.json").read_text())
    print(f"report {report}: reported {trial.intermediate_values}, reference "
          f"{study.trials[0].intermediate_values}, checkpoints {checkpoint_iterations(work)}")
    assert trial.user_attrs.get("pruned_at") == EVERY, f"not pruned: {trial.user_attrs}"
    assert live.get("search", {}).get("pruned_at") == EVERY and live["train"]["stopped_early_at"] == EVERY, live
    assert checkpoint_iterations(work) == [EVERY]           # stopped there, and its checkpoint kept
    assert (work / "models" / "model.pt").is_file() and "pruned by the search" in proc.stderr
    assert trial.intermediate_values[EVERY] < study.trials[0].intermediate_values[EVERY]


# ------------------------------------------------------------------------------------------- the search flow

def _search(repo, env, *args):
    return subprocess.Popen([sys.executable, "-m", "flows.search", "--repo", str(repo), *args],
                            cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _in_workspace(ws) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if str(ws) in p.cwd():
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


@pytest.mark.slow
def test_search_resumes_after_kill_prunes_and_applies_the_best(prefect_api, tmp_path):
    import optuna
    from optuna.trial import TrialState

    from detpipe.study import open_storage
    from support.search import learns_repo

    repo = learns_repo(tmp_path / "repo", train={"epochs": ITERATIONS, "eval_every": EVERY, "checkpoint_every": EVERY},
                       search={"study": "lrs", "n_trials": 2, "startup_trials": 1, "pruner": "median",
                               "space": {"train.lr": "choice 0.05 0.00001"}})
    journal = repo / "search" / "lrs.journal"
    study = optuna.create_study(study_name="lrs", storage=open_storage(str(journal)), direction="maximize")
    study.enqueue_trial({"train.lr": 0.05})
    study.enqueue_trial({"train.lr": 0.00001})
    env = stage_env(prefect_api.env)

    # 1. killed (SIGKILL, the search process alone) once trial 0 has its first checkpoint
    ws = repo / ".dvc" / "tmp" / "runs" / "lrs-t0"
    first = _search(repo, env)
    deadline = time.monotonic() + 600
    while not checkpoint_iterations(ws) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert first.poll() is None and checkpoint_iterations(ws), f"no checkpoint of trial 0:\n{first.stdout.read()}"
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    log1 = first.stdout.read()
    deadline = time.monotonic() + 60
    while _in_workspace(ws) and time.monotonic() < deadline:       # the training dies with the search
        time.sleep(0.5)
    assert not _in_workspace(ws), [p.cmdline() for p in _in_workspace(ws)]
    states = [t.state for t in optuna.load_study(study_name="lrs", storage=open_storage(str(journal))).trials]
    assert states[0] == TrialState.RUNNING and "Running stage 'train'" in log1, (states, log1[-3000:])
    killed_at = checkpoint_iterations(ws)[-1]

    # 2. the second search resumes trial 0 from that checkpoint, then runs (and prunes) trial 1
    second = _search(repo, env)
    log2, _ = second.communicate(timeout=900)
    assert second.returncode == 0, log2[-6000:]
    out = json.loads(log2[log2.index("{\n"):log2.rindex("\nbest: ")])
    rows = {r["trial"]: r for r in out["trials"]}
    assert sorted(rows) == [0, 1] and rows[0]["resumed"] and not rows[1]["resumed"], rows
    assert f"resuming from checkpoints/ckpt-{killed_at:07d}.pt (iteration {killed_at})" in log2, log2[-6000:]
    final = optuna.load_study(study_name="lrs", storage=open_storage(str(journal))).trials
    assert [t.state for t in final] == [TrialState.COMPLETE, TrialState.PRUNED], final
    assert final[1].user_attrs["pruned_at"] == EVERY
    saved = (len(final) * ITERATIONS - ITERATIONS - EVERY) / (len(final) * ITERATIONS)
    print(f"iterations saved by pruning: {saved:.2f}; trial 0 AP50 {final[0].value:.3f}")
    assert out["best"]["experiment"] == "lrs-t0" and log2.rstrip().endswith("best: lrs-t0")

    # 3. dvc exp show: both trials, their lr, AP50 and pruned state; the best applied brings its model
    shown = subprocess.run(["dvc", "exp", "show", "--json"], cwd=repo, env=env, capture_output=True, text=True,
                           check=True).stdout
    exps = {x["name"]: x["data"] for rev in json.loads(shown) for exp in (rev.get("experiments") or [])
            for x in exp["revs"]}
    assert set(exps) == {"lrs-t0", "lrs-t1"}, set(exps)
    metrics = {n: d["metrics"] for n, d in exps.items()}
    lrs = {n: d["params"]["params.yaml"]["data"]["train"]["lr"] for n, d in exps.items()}
    assert lrs == {"lrs-t0": 0.05, "lrs-t1": 1e-5}
    assert metrics["lrs-t1"]["dvclive/metrics.json"]["data"]["search"]["pruned_at"] == EVERY
    assert "search" not in metrics["lrs-t0"]["dvclive/metrics.json"]["data"]
    ap50 = metrics["lrs-t0"]["metrics/eval.json"]["data"]["bbox"]["AP50"]
    assert ap50 == pytest.approx(final[0].value)
    subprocess.run(["dvc", "exp", "apply", "lrs-t0"], cwd=repo, env=env, check=True, capture_output=True)
    applied = json.loads((repo / "metrics" / "eval.json").read_text())["bbox"]["AP50"]
    assert applied == pytest.approx(ap50) and (repo / "models" / "model.pt").is_file()
    assert not (repo / ".dvc" / "tmp" / "runs" / "lrs-t0").exists()    # the resumed trial's workspace, removed
