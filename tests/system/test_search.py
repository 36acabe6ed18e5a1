"""Hyperparameter search (docs/search.md) on the learns data (4 COCO128 images, val = the same images):

* the pruning test: the real train stage, a trial of a study whose one finished trial (lr 0.05, trained by the same
  stage, reporting its val AP50) sets the median; a hopeless lr (1e-5) is pruned at its first evaluation and every
  rank stops there, with its checkpoint and ``search.pruned_at`` in its metrics. Its must-fail variant runs the same
  with the report switched off (``DETPIPE_SEARCH_REPORT=0``): nothing is pruned and the test fails (strict xfail).
* the search test (issue 48 item 4, also its kill/resume and apply-the-best): ``python -m flows.search`` (Prefect, a
  real server) on a git + DVC repository of the learns data, 8 trials over ``train.lr: loguniform 1e-5 1`` (a seeded
  random sampler, the median pruner after 1 startup trial, 150 iterations a trial, evaluated every 10), SIGKILLed
  while trial 1 trains (trial 0 finished); the second search does not run trial 0 again, resumes trial 1 from its
  checkpoint in its kept workspace, runs the other 6 and prunes the hopeless ones (iterations saved >= `MIN_SAVED`),
  its best trial fits (AP50 >= 0.9), ``dvc exp show`` lists the 8 trials with their lr, AP50 and state (text), and
  ``dvc exp apply <best>`` brings the best model.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

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
    assert live["search"]["state"] == "pruned", live
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


# The 8-trial search (issue 48 item 4): a trial trains SEARCH8_ITERATIONS iterations (the learns test's 150, where
# lr 0.05 fits the 4 images: AP50 1.0), evaluated every SEARCH8_EVERY (the pruner's report points) and checkpointed
# every SEARCH8_CKPT (so the search is killed after a checkpoint of trial 1 and before its first report). The
# sampler is Optuna's RandomSampler, seeded: its lrs do not depend on the trials' results, so every machine draws the
# same 8: lr 0.046 and 0.0069 for trials 0-1 (seed 98), then 0.0052 0.00025 0.0013 0.17 1.1e-05 4.1e-05 (the resumed
# search's seed 98 + its 2 trials, `detpipe.orchestration.search.load_study`). The seed was chosen for a first trial near the
# learns test's lr (a draw in 0.035-0.07 comes first for 10 of the first 300 seeds): with one startup trial, that
# trial alone sets the median the others are pruned against. TPE's draws after its startup trials would follow the AP
# values, which differ in their last digits between machines.
SEARCH8_ITERATIONS, SEARCH8_EVERY, SEARCH8_CKPT = 150, 10, 5
SEARCH8_SEED = 98
FITS_AP50 = 0.9
# Iterations saved by pruning / iterations of 8 full trials: measured 0.817 (trials 1-7 pruned at their first report,
# docs/search.md). Trials 1 and 2 reported AP50 0.34 against the median's 0.40 at iteration 10: should both pass
# there on another machine and even train to the end, 0.58 would be saved; asserted with that margin.
MIN_SAVED = 0.5


def _exp_show(repo, env) -> dict[str, dict]:
    shown = subprocess.run(["dvc", "exp", "show", "--json"], cwd=repo, env=env, capture_output=True, text=True,
                           check=True).stdout
    return {x["name"]: x["data"] for rev in json.loads(shown) for exp in (rev.get("experiments") or [])
            for x in exp["revs"]}


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_search_of_8_trials_fits_prunes_resumes_after_kill_and_applies_the_best(prefect_api, tmp_path):
    """``python -m flows.search`` over ``train.lr: loguniform 1e-5 1``, 8 trials, median pruner (1 startup trial),
    on a git + DVC repository of the learns data, SIGKILLed while trial 1 trains (trial 0 finished); the second
    search runs no finished trial again, resumes trial 1 from its checkpoint, runs the other 6, prunes the hopeless
    ones, and its best trial fits (AP50 >= 0.9); ``dvc exp show`` lists the 8 trials with their lr, AP50 and
    state (text), and ``dvc exp apply <best>`` brings the best trial's metrics and model."""
    import optuna
    from optuna.trial import TrialState

    from detpipe.study import open_storage
    from support.search import learns_repo

    n, every = SEARCH8_ITERATIONS, SEARCH8_EVERY
    repo = learns_repo(tmp_path / "repo", train={"epochs": n, "eval_every": every, "checkpoint_every": SEARCH8_CKPT,
                                                 "log_every": every},
                       search={"study": "lr8", "n_trials": 8, "startup_trials": 1, "pruner": "median",
                               "sampler": "random", "seed": SEARCH8_SEED, "objective": "AP50",
                               "space": {"train.lr": "loguniform 1e-5 1"}})
    journal = repo / "search" / "lr8.journal"
    env = stage_env(prefect_api.env)

    def trials():
        return optuna.load_study(study_name="lr8", storage=open_storage(str(journal))).trials

    # 1. killed (SIGKILL, the search process alone) once trial 1 has its first checkpoint: trial 0 has finished
    ws = repo / ".dvc" / "tmp" / "runs" / "lr8-t1"
    first = _search(repo, env)
    deadline = time.monotonic() + 1800
    while not checkpoint_iterations(ws) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert first.poll() is None and checkpoint_iterations(ws), f"no checkpoint of trial 1:\n{first.stdout.read()}"
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    log1 = first.stdout.read()
    deadline = time.monotonic() + 60
    while _in_workspace(ws) and time.monotonic() < deadline:       # the training dies with the search
        time.sleep(0.5)
    assert not _in_workspace(ws), [p.cmdline() for p in _in_workspace(ws)]
    assert [t.state for t in trials()] == [TrialState.COMPLETE, TrialState.RUNNING], (trials(), log1[-3000:])
    killed_at = checkpoint_iterations(ws)[-1]

    # 2. the second search: trial 0 is not run again, trial 1 resumes from that checkpoint, then trials 2..7
    second = _search(repo, env)
    log2, _ = second.communicate(timeout=3600)
    assert second.returncode == 0, log2[-6000:]
    out = json.loads(log2[log2.index("{\n"):log2.rindex("\nbest: ")])
    rows = {r["trial"]: r for r in out["trials"]}
    assert sorted(rows) == list(range(1, 8)) and rows[1]["resumed"], rows
    assert not any(r["resumed"] for t, r in rows.items() if t != 1), rows
    assert f"resuming from checkpoints/ckpt-{killed_at:07d}.pt (iteration {killed_at})" in log2, log2[-6000:]
    assert "lr8-t0" not in log2.split("best trial:")[0], "trial 0 (finished) ran again"
    final = trials()
    states = [t.state for t in final]
    assert len(final) == 8 and set(states) <= {TrialState.COMPLETE, TrialState.PRUNED}, final
    trained = {t.number: t.user_attrs["pruned_at"] if t.state == TrialState.PRUNED else n for t in final}
    saved = sum(n - k for k in trained.values()) / (8 * n)
    lrs = {t.number: t.params["train.lr"] for t in final}
    print("trials: " + "; ".join(f"{t.number} lr {lrs[t.number]:.3g} {t.state.name} AP50 {t.value:.3f} "
                                 f"({trained[t.number]} it)" for t in final))
    print(f"iterations saved by pruning / total: {saved:.3f}")
    best = max((t for t in final if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    assert out["best"]["experiment"] == f"lr8-t{best.number}" and log2.rstrip().endswith(f"best: lr8-t{best.number}")
    assert best.value >= FITS_AP50, f"no trial fits: best {best.number} lr {lrs[best.number]} AP50 {best.value}"
    assert states.count(TrialState.PRUNED) >= 3 and saved >= MIN_SAVED, (states, saved)
    for t in final:
        if t.state == TrialState.PRUNED:  # a pruned trial was worse than the median of the finished ones there
            at = t.user_attrs["pruned_at"]
            done = [u.intermediate_values[at] for u in final if u.state == TrialState.COMPLETE and u.number < t.number]
            assert t.intermediate_values[at] < max(done), (t.number, at, t.intermediate_values[at], done)

    # 3. dvc exp show: the 8 trials with their lr, AP50 and state; the 80-column view the docs show
    exps = _exp_show(repo, env)
    assert set(exps) == {f"lr8-t{i}" for i in range(8)}, set(exps)
    for t in final:
        d = exps[f"lr8-t{t.number}"]
        live = d["metrics"]["dvclive/metrics.json"]["data"]["search"]
        assert d["params"]["params.yaml"]["data"]["train"]["lr"] == pytest.approx(lrs[t.number])
        assert live["state"] == t.state.name.lower(), (t.number, live)
        if t.state == TrialState.COMPLETE:
            assert d["metrics"]["metrics/eval.json"]["data"]["bbox"]["AP50"] == pytest.approx(t.value)
        else:
            assert live["pruned_at"] == t.user_attrs["pruned_at"]
    table = subprocess.run(["dvc", "exp", "show", "--hide-workspace", "--drop", ".*", "--keep",
                            r"Experiment|search\.state|bbox\.AP50$|params\.yaml:train\.lr"], cwd=repo,
                           env={**env, "COLUMNS": "80"}, capture_output=True, text=True, check=True).stdout
    print(table)
    assert all(f"lr8-t{i}" in table for i in range(8)) and "pruned" in table and "complete" in table, table

    # 4. the best trial applied brings its params, metrics and model (the md5 its experiment's dvc.lock records)
    name = f"lr8-t{best.number}"
    subprocess.run(["dvc", "exp", "apply", name], cwd=repo, env=env, check=True, capture_output=True)
    applied = json.loads((repo / "metrics" / "eval.json").read_text())["bbox"]["AP50"]
    assert applied == pytest.approx(best.value)
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    md5 = next(o["md5"] for o in lock["stages"]["train"]["outs"] if o["path"] == "models/model.pt")
    assert hashlib.md5((repo / "models" / "model.pt").read_bytes()).hexdigest() == md5
    assert yaml.safe_load((repo / "params.yaml").read_text())["train"]["lr"] == pytest.approx(lrs[best.number])
    assert not (repo / ".dvc" / "tmp" / "runs" / "lr8-t1").exists()    # the resumed trial's workspace, removed


def test_a_search_refuses_num_plot_images_0_in_one_line(tmp_path, capsys):
    """``evaluate.num_plot_images: 0`` leaves plots/val_images empty, and git keeps no empty folder, so every trial's
    ``dvc exp save`` would fail (``output 'plots/val_images' does not exist``, seen in a one-trial search): the search
    stops before any trial with a one-line error naming the key (exit status 2); with 1 the same check passes."""
    from flows.search import main, settings
    from support.pipeline import set_params
    from support.repos import copy_repo

    repo = copy_repo(tmp_path / "repo", n_images=1)
    set_params(repo, {"evaluate": {"num_plot_images": 0}})
    assert main(["--repo", str(repo), "--set", "space.train.lr=loguniform 1e-4 1e-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "key 'evaluate.num_plot_images' is 0" in err and "params.yaml" in err, err
    set_params(repo, {"evaluate": {"num_plot_images": 1}})
    assert settings(repo, {"n_trials": 3}).n_trials == 3
