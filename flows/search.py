"""Prefect flow ``search`` (also ``sweep/main`` with a ``search`` parameter, and ``python -m flows.search``): an
Optuna hyperparameter search whose every trial is a DVC experiment (docs/search.md).

The ``search`` section of params.yaml says what to vary and how (`detpipe.params.Search`). ``search.max_parallel``
lanes (Prefect tasks; with more than one, the stages before training are reproduced once first, as a sweep does)
each loop: claim a trial (`detpipe.orchestration.search.claim`: a new one, or a running one whose search
died), run it as a ``train`` flow run named ``<study>-t<N>`` (its own workspace ``.dvc/tmp/runs/<study>-t<N>``, the
trial's params as overrides, its trial written there so that training reports val AP to it and is pruned through
the early-stopping path), then tell the study the result read from metrics/eval.json (or PRUNED / FAIL). The
search ends when the study has ``search.n_trials`` finished trials; it prints the best trial's experiment name.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from detpipe import params as params_mod
from detpipe.orchestration import search as search_ops
from flows.train import REPO_ENV, repository, train


def settings(root: Path, changes: dict[str, Any] | None) -> params_mod.Search:
    """The repository's ``search`` section (params.yaml) with ``changes`` (``{"n_trials": 3, "space":
    {...}}``) applied. Raises StageError (bad params.yaml, or ``evaluate.num_plot_images`` 0: a trial's ``dvc exp
    save`` then fails with ``output 'plots/val_images' does not exist``, since git keeps no empty folder) or
    pydantic's ValidationError (bad changes)."""
    from detpipe.core.errors import StageError

    if params_mod.load("evaluate", path=root / "params.yaml").num_plot_images < 1:
        raise StageError(f"{root / 'params.yaml'}: key 'evaluate.num_plot_images' is 0: a search trial is saved as a "
                         "DVC experiment, whose output plots/val_images must hold at least one image; set it to 1 or more")
    base = params_mod.load("search", path=root / "params.yaml").model_dump()
    return params_mod.Search.model_validate({**base, **(changes or {})})


@task(name="search-lane", task_run_name="lane-{lane}", cache_policy=NO_CACHE, persist_result=False)
def run_lane(cfg: params_mod.Search, root: str, lane: int) -> list[dict]:
    """Claim and run trials one after another until none is left; returns one row per trial run:
    ``{trial, experiment, state, value, params, resumed}``."""
    logger, rows = get_run_logger(), []
    study, me = search_ops.load_study(cfg, Path(root), lane), search_ops.owner()
    while (claimed := search_ops.claim(study, cfg, Path(root), me)) is not None:
        number, overrides, resumed = claimed
        name = search_ops.experiment_name(cfg.study, number)
        logger.info("%s trial %d (%s): %s", "resuming" if resumed else "starting", number, name, overrides)
        state = train.with_options(flow_run_name=name)(
            overrides=overrides, repo=root, trial=search_ops.trial_spec(cfg, Path(root), number),
            workspace_id=name, return_state=True)
        result = state.result(raise_on_failure=False) if state.is_completed() else None
        status = search_ops.finish(study, number, result["metrics"] if result else None, cfg.objective)
        value = study.trials[number].value
        logger.info("trial %d (%s): %s, %s %s", number, name, status, cfg.objective, value)
        rows.append({"trial": number, "experiment": name, "state": status, "value": value, "params": overrides,
                     "resumed": resumed})
    return rows


@flow(name="search", persist_result=True)
def search(search_settings: dict[str, Any] | None = None, repo: str | None = None) -> dict:
    """Run the search of the repository's ``search`` section (with ``search_settings`` changes) to ``n_trials``.

    Returns:
        ``{"study", "storage", "trials": [rows of this run], "best": {"trial", "experiment", "value", "params"}}``
        (``best`` over the whole study, None when no trial completed); also the table artifact
        ``search-results``.
    Raises:
        StageError / ValidationError: bad search settings; ValueError: an empty space.
    """
    logger = get_run_logger()
    root = repository(repo)
    cfg = settings(root, search_settings)
    search_ops.load_study(cfg, root)    # create it (and fail on bad settings) before any lane starts
    if cfg.pruner != "none" and not params_mod.load("train", path=root / "params.yaml").eval_every:
        logger.warning("search.pruner %s prunes nothing: train.eval_every is 0, so training reports no val AP",
                       cfg.pruner)
    if cfg.max_parallel > 1:    # as a sweep: the stages before training once, not raced by parallel trials
        train.with_options(flow_run_name=f"{cfg.study}-shared")(overrides={}, repo=str(root), upto="augment")
    lanes = [run_lane.submit(cfg, str(root), i) for i in range(min(cfg.max_parallel, cfg.n_trials))]
    rows = sorted((r for f in lanes for r in f.result()), key=lambda r: r["trial"])
    study = search_ops.load_study(cfg, root)
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    best = max(done, key=lambda t: t.value) if done else None
    out = {"study": cfg.study, "storage": search_ops.storage_url(cfg.storage, cfg.study, root), "trials": rows,
           "best": None if best is None else {"trial": best.number, "value": best.value, "params": best.params,
                                              "experiment": search_ops.experiment_name(cfg.study, best.number)}}
    if rows:
        create_table_artifact(key="search-results", description=f"search {cfg.study}", table=[
            {"trial": r["trial"], "experiment": r["experiment"], "state": r["state"], cfg.objective: r["value"],
             **{k: json.dumps(v) for k, v in r["params"].items()}} for r in rows])
    logger.info("best trial: %s", json.dumps(out["best"]))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.search [--set KEY=VALUE ...] [--repo PATH]``: one search in this process. KEY is a key of
    the ``search`` section (``n_trials=3``) or ``space.<section>.<key>`` (``'space.train.lr=loguniform 1e-5 1'``),
    VALUE read as YAML. Prints the result as JSON and ``best: <experiment>``. Exit status 0, 2 on bad settings,
    1 when the search fails or every trial it ran failed (`all_failed`)."""
    from pydantic import ValidationError
    from ruamel.yaml import YAML

    from detpipe.core.errors import StageError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                        help="search setting for this run, e.g. n_trials=3 or 'space.train.lr=loguniform 1e-5 1'")
    parser.add_argument("--repo", default=None, help=f"repository (default ${REPO_ENV}, else this checkout)")
    args = parser.parse_args(argv)
    changes: dict[str, Any] = {}
    try:
        for item in args.set:
            key, eq, text = item.partition("=")
            if not eq:
                raise ValueError(f"--set {item!r}: expected KEY=VALUE")
            if key.startswith("space."):
                changes.setdefault("space", {})[key[len("space."):]] = text
            else:
                changes[key] = YAML(typ="safe", pure=True).load(text)
        cfg = settings(repository(args.repo), changes)
        if not cfg.space:
            raise ValueError("search.space is empty: name at least one param, e.g. "
                             "--set 'space.train.lr=loguniform 1e-4 1e-1'")
    except ValidationError as e:
        err = e.errors()[0]
        print(f"error: key 'search.{'.'.join(str(p) for p in err['loc'])}': {err['msg']}", file=sys.stderr)
        return 2
    except (ValueError, StageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    state = search(search_settings=changes or None, repo=args.repo, return_state=True)
    if not state.is_completed():
        print(f"error: flow run {state.name}: {state.message}", file=sys.stderr)
        return 1
    out = state.result()
    print(json.dumps(out, indent=2))
    print(f"best: {out['best']['experiment'] if out['best'] else '(no trial completed)'}")
    failure = all_failed(out)
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0


def all_failed(out: dict) -> str | None:
    """Why a finished search run failed as a whole, or None: every trial it ran ended FAIL (a broken stage or bad
    search space fails each trial alike; the flow itself completes). ``out``: `search`'s result. A run that ran no
    trial (the study had its ``n_trials`` already) or whose trials were pruned has not failed."""
    rows = out.get("trials") or []
    if not rows or any(r["state"] != "FAIL" for r in rows):
        return None
    names = ", ".join(r["experiment"] for r in rows)
    return (f"every trial of this search failed ({len(rows)}: {names}); the train flow runs of those names "
            f"say why")


if __name__ == "__main__":
    sys.exit(main())
