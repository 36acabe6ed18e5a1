"""The Optuna side of a hyperparameter search that a training needs (docs/search.md): opening the study's storage,
its pruner, and the reporter through which rank 0's val evaluations reach the trial.

A search trial's training finds its trial in `TRIAL_FILE` of its workspace (written by the ``train`` flow for a
search, `write_trial_file`; ``.dvc/tmp`` is ignored by git and DVC, so it is neither a param nor an output and
changes no stage's fingerprint). Without that file a training is no trial and nothing here is imported by it.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("detpipe.study")

TRIAL_FILE = Path(".dvc") / "tmp" / "search-trial.json"
REPORT_ENV = "DETPIPE_SEARCH_REPORT"   # "0": trainings report nothing to their trial (a check that pruning is real)


def default_storage(study: str) -> str:
    """The default storage of study ``study``, relative to the repository: ``search/<study>.journal``."""
    return f"search/{study}.journal"


def storage_url(storage: str | None, study: str, root: Path) -> str:
    """``search.storage`` made usable from any workspace: a database URL as is, a path (default
    `default_storage`) absolute under ``root``."""
    storage = storage or default_storage(study)
    if "://" in storage:
        return storage
    return str((Path(root) / storage).resolve())


def open_storage(url: str):
    """An Optuna storage for ``url`` (`storage_url`): a database URL -> ``RDBStorage`` (SQLite, PostgreSQL, ...);
    a path ending ``.db`` -> ``RDBStorage`` on that SQLite file; any other path -> ``JournalStorage`` on a
    ``JournalFileBackend`` (file-locked appends: safe for several processes on one machine or a shared POSIX
    file system). Parent folders are created. Raises ``ImportError`` without the database driver."""
    import optuna

    if "://" in url:
        return optuna.storages.RDBStorage(url)
    path = Path(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".db":
        return optuna.storages.RDBStorage(f"sqlite:///{path}")
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def make_pruner(name: str, startup_trials: int):
    """Optuna's pruner ``name`` (``median``: ``MedianPruner(n_startup_trials=startup_trials)``; ``hyperband``:
    ``HyperbandPruner()``; ``none``: ``NopPruner()``)."""
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def write_trial_file(ws: Path, trial: dict) -> Path:
    """Write ``trial`` (``storage`` URL, ``study`` name, ``number``, ``objective``, ``pruner``,
    ``startup_trials``) to workspace ``ws``'s `TRIAL_FILE`; returns its path."""
    path = Path(ws) / TRIAL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trial))
    return path


class TrialReporter:
    """``reporter(stats, iteration) -> reason | None`` for `detpipe.engine.hooks.EvalHook`, called on rank 0 after
    each val evaluation: reports ``stats[objective]`` (a fraction, 0-1) at ``iteration`` to the trial
    (``Trial.report``) and returns a stop reason when the study's pruner says to prune it (``should_prune``), else
    None. The study is opened at the first call. With ``$DETPIPE_SEARCH_REPORT`` = ``0`` it reports nothing and
    never prunes."""

    def __init__(self, trial: dict):
        self.spec = trial
        self.trial = None

    @classmethod
    def from_workspace(cls, root: Path = Path(".")) -> "TrialReporter | None":
        """The reporter of the trial named in ``root``'s `TRIAL_FILE`, or None when there is none (no search)."""
        path = Path(root) / TRIAL_FILE
        return cls(json.loads(path.read_text())) if path.is_file() else None

    def _open(self):
        import optuna

        s = self.spec
        study = optuna.load_study(study_name=s["study"], storage=open_storage(s["storage"]),
                                  pruner=make_pruner(s["pruner"], int(s["startup_trials"])))
        trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, int(s["number"]))
        return optuna.trial.Trial(study, trial_id)

    def __call__(self, stats: dict, iteration: int) -> str | None:
        if os.environ.get(REPORT_ENV) == "0":
            return None
        if self.trial is None:
            self.trial = self._open()
        value = float(stats[self.spec["objective"]])
        self.trial.report(value, iteration)
        if self.trial.should_prune():
            self.trial.set_user_attr("pruned_at", iteration)   # detpipe.orchestration.search.PRUNED_ATTR: told PRUNED
            log.info("trial %s of study %s pruned at iteration %d (val %s %.4f)", self.spec["number"],
                     self.spec["study"], iteration, self.spec["objective"], value)
            return (f"pruned by the search (study {self.spec['study']}, trial {self.spec['number']}, "
                    f"{self.spec['pruner']} pruner): val {self.spec['objective']} {value:.4f} at iteration {iteration}")
        return None
