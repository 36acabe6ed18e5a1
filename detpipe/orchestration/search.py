"""The search driver's Optuna side (docs/search.md): the study (created or loaded, seeded sampler, pruner, storage),
which trial to run next (a new one asked, or a running one whose search died: resumed), and its result told.

Trials are claimed under a file lock (``<repository>/search/<study>.lock``), so searches on one study from this
machine never claim the same trial and never run more than ``search.n_trials`` trials in all. A trial records its
owner (host, pid and the process's start time) as the user attribute ``owner``; a RUNNING trial whose owner
process is gone (same host) is taken over and resumed in its kept workspace, from its newest checkpoint.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

import psutil

from detpipe import params as params_mod
from detpipe.study import make_pruner, open_storage, storage_url

OWNER_ATTR = "owner"
PRUNED_ATTR = "pruned_at"   # set by `detpipe.study.TrialReporter` when the pruner stops the trial


def experiment_name(study: str, number: int) -> str:
    """The DVC experiment (and flow run, and workspace) name of trial ``number`` of ``study``: ``<study>-t<N>``."""
    return f"{study}-t{number}"


def load_study(cfg: params_mod.Search, root: Path, lane: int = 0):
    """Create or load (``load_if_exists``) the study ``cfg.study`` in its storage (`detpipe.study.storage_url`),
    direction maximize, with the seeded sampler (``TPESampler(seed, n_startup_trials=startup_trials)`` or
    ``RandomSampler(seed)``, seed = ``cfg.seed`` + the trials the study already has + ``lane``: parallel lanes of
    one search, loaded at the same moment, would otherwise draw the same params) and `detpipe.study.make_pruner`. Raises ``ValueError`` when ``cfg.space`` is empty."""
    import optuna

    if not cfg.space:
        raise ValueError("search.space is empty: name at least one param to search, e.g. "
                         "train.lr: loguniform 1e-4 1e-1")
    storage = open_storage(storage_url(cfg.storage, cfg.study, root))
    # a search resumed on a study with trials seeds its sampler further on: seeded as the first search was, it
    # would draw that search's first params again
    try:
        seed = cfg.seed + lane + len(optuna.load_study(study_name=cfg.study, storage=storage).get_trials(
            deepcopy=False))
    except KeyError:    # no such study yet
        seed = cfg.seed + lane
    sampler = (optuna.samplers.TPESampler(seed=seed, n_startup_trials=cfg.startup_trials)
               if cfg.sampler == "tpe" else optuna.samplers.RandomSampler(seed=seed))
    return optuna.create_study(study_name=cfg.study, storage=storage,
                               sampler=sampler, pruner=make_pruner(cfg.pruner, cfg.startup_trials),
                               direction="maximize", load_if_exists=True)


def suggest(trial, space: dict[str, str]) -> dict:
    """The params overrides of ``trial`` for ``space`` (`detpipe.params.parse_space_item` entries), each suggested
    under its dotted path: loguniform/uniform ``suggest_float`` (log or not), int ``suggest_int``, choice
    ``suggest_categorical``."""
    out = {}
    for path, spec in space.items():
        dist, args = params_mod.parse_space_item(path, spec)
        if dist == "choice":
            out[path] = trial.suggest_categorical(path, args)
        elif dist == "int":
            out[path] = trial.suggest_int(path, args[0], args[1])
        else:
            out[path] = trial.suggest_float(path, args[0], args[1], log=dist == "loguniform")
    return out


def owner() -> dict:
    """This process as a trial's owner: host, pid and start time (so a reused pid is not taken for it)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": psutil.Process().create_time()}


def owner_alive(who: dict | None) -> bool:
    """Whether the process ``who`` (`owner`) still runs; an owner on another host counts as alive (it cannot
    be checked from here)."""
    if not who:
        return False
    if who.get("host") != socket.gethostname():
        return True
    try:
        return abs(psutil.Process(int(who["pid"])).create_time() - float(who["start"])) < 0.01
    except (psutil.NoSuchProcess, KeyError, ValueError):
        return False


@contextlib.contextmanager
def study_lock(root: Path, study: str):
    """An exclusive ``flock`` on ``<root>/search/<study>.lock`` for the block (waits for it)."""
    path = Path(root) / "search" / f"{study}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def claim(study, cfg: params_mod.Search, root: Path, me: dict) -> tuple[int, dict, bool] | None:
    """The next trial this search runs, as ``(number, overrides, resumed)``: a RUNNING trial whose owner is dead
    (`owner_alive`) is taken over (``resumed``), else a new trial is asked (an enqueued one first:
    ``study.enqueue_trial``) while the study has fewer than ``cfg.n_trials`` trials (any state but WAITING); None when there is nothing left to run. Under `study_lock`."""
    from optuna.trial import TrialState

    with study_lock(root, cfg.study):
        trials = study.get_trials(deepcopy=False)
        for t in trials:
            if t.state == TrialState.RUNNING and not owner_alive(t.user_attrs.get(OWNER_ATTR)):
                study._storage.set_trial_user_attr(t._trial_id, OWNER_ATTR, me)
                return t.number, dict(t.params), True
        if sum(t.state != TrialState.WAITING for t in trials) >= cfg.n_trials:   # enqueued ones are not run yet
            return None
        trial = study.ask()
        trial.set_user_attr(OWNER_ATTR, me)
        return trial.number, suggest(trial, cfg.space), False


def trial_spec(cfg: params_mod.Search, root: Path, number: int) -> dict:
    """What a trial's training needs to report to it (`detpipe.study.TrialReporter`)."""
    return {"storage": storage_url(cfg.storage, cfg.study, root), "study": cfg.study, "number": number,
            "objective": cfg.objective, "pruner": cfg.pruner, "startup_trials": cfg.startup_trials}


def finish(study, number: int, metrics: dict | None, objective: str) -> str:
    """Tell the study how trial ``number`` ended and return its state's name: PRUNED when its training was pruned
    (user attribute `PRUNED_ATTR`; Optuna records its last reported value), COMPLETE with ``metrics[objective]``
    (metrics/eval.json's bbox stats), FAIL when ``metrics`` is None (the run failed)."""
    from optuna.trial import TrialState

    frozen = study._storage.get_trial(study._storage.get_trial_id_from_study_id_trial_number(study._study_id,
                                                                                            number))
    if metrics is None:
        study.tell(number, state=TrialState.FAIL)
    elif PRUNED_ATTR in frozen.user_attrs:
        study.tell(number, state=TrialState.PRUNED)
    else:
        study.tell(number, float(metrics[objective]))
    return study._storage.get_trial(frozen._trial_id).state.name
