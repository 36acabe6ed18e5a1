"""The ``search`` section of params.yaml (docs/search.md): a bad space entry stops with one line naming the key and
the rule; a good one is sampled by Optuna within its bounds under its dotted path."""
from __future__ import annotations

import pytest
from ruamel.yaml import YAML

from detpipe import params as params_mod
from detpipe.core.errors import StageError
from support.procs import REPO


def _write(tmp_path, search: dict):
    yaml = YAML(typ="safe", pure=True)
    data = yaml.load((REPO / "params.yaml").read_text())
    data["search"] = {**data["search"], **search}
    path = tmp_path / "params.yaml"
    with open(path, "w") as f:
        yaml.dump(data, f)
    return path


@pytest.mark.parametrize("space, says", [
    ({"train.lrr": "uniform 0.01 0.1"}, "'train.lrr': no such param"),
    ({"train.lr": "gauss 0 1"}, "train.lr: 'gauss 0 1': expected one of"),
    ({"train.lr": "uniform 0 1"}, "train.lr: value 0.0 of 'uniform 0 1': Input should be greater than 0"),
    ({"train.lr": "loguniform 1e-1 1e-4"}, "loguniform needs two numbers LOW < HIGH"),
    ({"train.epochs": "int 0 8"}, "train.epochs: value 0 of 'int 0 8': Input should be greater than or equal to 1"),
    ({"train.epochs": "int 2 8.5"}, "int needs two integers LOW < HIGH"),
    ({"train.schedule": "choice cosine linear"}, "value 'linear' of 'choice cosine linear'"),
    ({"train.lr": "choice 0.1"}, "choice needs at least two values"),
    ({"flows.retries": "int 0 2"}, "a search varies only train or augment params"),
])
def test_a_bad_space_is_one_line_naming_the_key(tmp_path, space, says):
    with pytest.raises(StageError) as e:
        params_mod.load("search", _write(tmp_path, {"space": space}))
    msg = str(e.value)
    assert "\n" not in msg and "key 'search.space'" in msg and says in msg, msg


def test_other_search_keys_are_checked_like_any_param(tmp_path):
    for bad, key in (({"pruner": "percentile"}, "search.pruner"), ({"n_trials": 0}, "search.n_trials"),
                     ({"study": "a b"}, "search.study"), ({"sampler2": "tpe"}, "search.sampler2")):
        with pytest.raises(StageError, match=f"key '{key}'"):
            params_mod.load("search", _write(tmp_path, bad))


def test_a_good_space_is_sampled_within_its_bounds(tmp_path):
    import optuna

    from detpipe.orchestration.search import suggest

    cfg = params_mod.load("search", _write(tmp_path, {"space": {
        "train.lr": "loguniform 1e-5 1", "train.weight_decay": "uniform 0 0.001", "train.epochs": "choice 4 8 16",
        "augment.copies": "int 0 3"}}))
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    seen = [suggest(study.ask(), cfg.space) for _ in range(20)]
    for s in seen:
        assert 1e-5 <= s["train.lr"] <= 1 and 0 <= s["train.weight_decay"] <= 0.001
        assert s["train.epochs"] in (4, 8, 16) and s["augment.copies"] in range(4)
    assert len({s["train.lr"] for s in seen}) == 20 and {s["train.epochs"] for s in seen} == {4, 8, 16}
    assert min(s["train.lr"] for s in seen) < 1e-3 < max(s["train.lr"] for s in seen)   # log scale: spread over decades


@pytest.mark.parametrize("args, says", [
    (["--set", "n_trials=0"], "error: key 'search.n_trials': Input should be greater than or equal to 1"),
    (["--set", "space.train.lr=loguniform 0 1"], "loguniform needs LOW > 0"),
    (["--set", "sampler=grid"], "error: key 'search.sampler'"),
    ([], "error: search.space is empty"),
])
def test_the_cli_refuses_bad_settings_in_one_line(capsys, args, says):
    from flows.search import main

    assert main(["--repo", str(REPO), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err


def test_claims_never_share_a_trial_and_take_over_only_dead_owners(tmp_path):
    """`detpipe.orchestration.search.claim` on a journal-file study: two live searches get distinct trials and together no more
    than ``n_trials``; a RUNNING trial whose owner process has exited is taken over with its params; a FINISHED one
    never is."""
    import subprocess
    import sys

    from optuna.trial import TrialState

    from detpipe.orchestration import search as search_ops

    cfg = params_mod.load("search", _write(tmp_path, {"study": "claims", "n_trials": 3, "storage": "s.journal",
                                                      "space": {"train.lr": "loguniform 1e-5 1"}}))
    me = search_ops.owner()
    dead_proc = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = {**me, "pid": dead_proc.pid, "start": __import__("psutil").Process(dead_proc.pid).create_time()}
    dead_proc.wait()
    a, b = search_ops.load_study(cfg, tmp_path), search_ops.load_study(cfg, tmp_path)   # two searches
    n0, p0, r0 = search_ops.claim(a, cfg, tmp_path, dead)       # owned by a process that is gone now
    n1, _, r1 = search_ops.claim(b, cfg, tmp_path, me)          # taken over: trial 0, its params
    assert (n0, r0) == (0, False) and (n1, r1) == (0, True)
    assert search_ops.claim(a, cfg, tmp_path, me)[0] == 1 and search_ops.claim(b, cfg, tmp_path, me)[0] == 2
    assert search_ops.claim(a, cfg, tmp_path, me) is None       # 3 trials in all, none of them ownerless
    b.tell(1, 0.5)
    assert search_ops.claim(b, cfg, tmp_path, dead) is None     # finished trials are never run again
    assert [t.state for t in a.get_trials()] == [TrialState.RUNNING, TrialState.COMPLETE, TrialState.RUNNING]
    assert a.trials[0].user_attrs["owner"] == me and a.trials[0].params == p0 == {"train.lr": p0["train.lr"]}


def test_parallel_lanes_draw_different_params(tmp_path):
    """Two lanes of one search load the study at the same moment: their samplers are seeded apart (by lane), so
    their first trials do not repeat each other's params (found by a 2-lane search that ran lr 0.0125 twice)."""
    from detpipe.orchestration import search as search_ops

    cfg = params_mod.load("search", _write(tmp_path, {"study": "lanes", "n_trials": 4, "storage": "s.journal",
                                                      "space": {"train.lr": "loguniform 1e-5 1"}}))
    a, b = search_ops.load_study(cfg, tmp_path, 0), search_ops.load_study(cfg, tmp_path, 1)
    me = search_ops.owner()
    first, second = search_ops.claim(a, cfg, tmp_path, me), search_ops.claim(b, cfg, tmp_path, me)
    assert (first[0], second[0]) == (0, 1) and first[1] != second[1], (first, second)


def test_a_search_whose_every_trial_failed_exits_1():
    """`flows.search.all_failed` (``python -m flows.search``'s exit status 1): every trial of the run FAIL is a
    failed search, naming the trials; one COMPLETE or PRUNED trial among failures, or no trial run at all (the
    study was full already), is not."""
    from flows.search import all_failed

    def row(n, state):
        return {"trial": n, "experiment": f"s-t{n}", "state": state, "value": None, "params": {}, "resumed": False}

    failed = all_failed({"trials": [row(0, "FAIL"), row(1, "FAIL")], "best": None})
    assert failed and "every trial of this search failed (2: s-t0, s-t1)" in failed, failed
    assert all_failed({"trials": [row(0, "FAIL"), row(1, "PRUNED")], "best": None}) is None
    assert all_failed({"trials": [row(0, "COMPLETE"), row(1, "FAIL")], "best": {"trial": 0}}) is None
    assert all_failed({"trials": [], "best": None}) is None
