"""Prefect flow ``sweep`` (deployment ``sweep/main``): a grid or list of params overrides run as parallel DVC
experiments, e.g. ``python -m flows.sweep -p 'train.lr=[0.01,0.02]' -p train.epochs=4``.

Stages whose params all runs share (download, convert, augment) run once first; DVC's run cache in the shared
cache then gives every experiment their outputs. Then one `train` flow run per override set, at most
``flows.max_parallel`` at once (a Prefect tag concurrency limit on the ``sweep-run`` tasks).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

from detpipe import params as params_mod
from detpipe.orchestration import overrides
from detpipe.orchestration.experiments import experiment_name
from flows.search import search as search_flow
from flows.train import REPO_ENV, report, repository, train

LIMIT_TAG = "detpipe-experiment"
SHARED = ("download", "convert", "augment")  # stages before training


@task(name="sweep-run", task_run_name="{name}", tags=[LIMIT_TAG], cache_policy=NO_CACHE, persist_result=False)
def experiment(overrides: dict[str, Any], repo: str, name: str) -> dict:
    """One `train` flow run (a DVC experiment named ``name``) with ``overrides``."""
    return train.with_options(flow_run_name=name)(overrides=overrides, repo=repo)


@flow(name="sweep", persist_result=True)
def sweep(grid: dict[str, Any] | None = None, runs: list[dict[str, Any]] | None = None,
          repo: str | None = None, search: dict[str, Any] | None = None) -> list[dict] | dict:
    """Run every override set of ``grid``/``runs`` (see `detpipe.orchestration.overrides.expand`) as an experiment named
    ``<sweep run name>-<i>``; returns their results and publishes table artifact ``sweep-results`` (runs ×
    overrides × AP, AP50).

    With ``search`` (a dict, ``{}`` for params.yaml's ``search`` section as it is, else changes to it such as
    ``{"n_trials": 4}``) it runs the Optuna search instead (`flows.search.search`, docs/search.md) and returns its
    result (its flow run is named ``<sweep run name>-search``); ``grid`` and ``runs`` must then be empty."""
    if search is not None:
        if grid or runs:
            raise ValueError("sweep: give either grid/runs or search, not both")
        return search_flow.with_options(flow_run_name=f"{experiment_name(flow_run.get_name())}-search")(
            search_settings=search or None, repo=repo)
    sets = overrides.expand(grid, runs)
    root = repository(repo)
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=LIMIT_TAG, concurrency_limit=params_mod.load(
            "flows", path=root / "params.yaml").max_parallel)
    name = experiment_name(flow_run.get_name())
    shared = {k: v for k, v in sets[0].items() if k.split(".")[0] in SHARED and all(s.get(k) == v for s in sets)}
    train.with_options(flow_run_name=f"{name}-shared")(overrides=shared, repo=str(root), upto=SHARED[-1])
    futures = [experiment.submit(s, str(root), f"{name}-{i}") for i, s in enumerate(sets)]
    results = [f.result() for f in futures]
    create_table_artifact(key="sweep-results", table=[
        {"experiment": r["experiment"], **{k: json.dumps(v) for k, v in s.items()}, "AP": r["metrics"]["AP"],
         "AP50": r["metrics"]["AP50"]} for s, r in zip(sets, results)], description=f"sweep {name}")
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.sweep -p 'train.lr=[0.01,0.02]' [-p key=value ...] [--repo PATH]``: one sweep in this
    process; a list value is a grid axis. Exit status 0, 2 on bad overrides, 1 when a run fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--param", "-p", action="append", default=[], metavar="SECTION.KEY=VALUE|[V1,V2]")
    parser.add_argument("--repo", default=None, help=f"repository (default ${REPO_ENV}, else this checkout)")
    args = parser.parse_args(argv)
    try:
        grid = overrides.parse(args.param)
        overrides.expand(grid)
    except overrides.OverrideError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return report(sweep(grid=grid, repo=args.repo, return_state=True))


if __name__ == "__main__":
    sys.exit(main())
