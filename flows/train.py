"""Prefect flow ``train``: the DVC pipeline, one task per stage, each run a DVC experiment in its own workspace.

``python -m flows.train [--param train.lr=0.01 ...] [--repo PATH]`` runs it once in this process; ``python -m
flows.serve`` serves it as deployment ``train/main``. A run works in a git worktree of the repository's commit
sharing its DVC cache (`detpipe.orchestration.workspace`), writes its overrides into that worktree's params.yaml
(`detpipe.orchestration.overrides`), runs ``dvc repro --single-item <stage>`` per stage task (DVC skips what is up to date;
commands bound to the run's life by `detpipe.orchestration.processes`) and saves the worktree as DVC experiment named after the
flow run (`detpipe.orchestration.experiments`: ``dvc exp save``, with the ``cache: false`` metrics and plots ``dvc exp run``
would commit).

With ``sync`` (always in a ``--source`` deployment, whose clone is thrown away) the run also pulls from and
pushes to the team's remotes (`detpipe.orchestration.remotes`): it fails at once without them, continues an experiment of
its name an earlier attempt pushed, pushes each stage's outputs, training's checkpoints while it runs and what
it has when it fails, and ends with ``dvc exp push origin <name>``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from detpipe.core import lifeline
from detpipe import params as params_mod
from detpipe.orchestration import experiments, remotes, workspace
from detpipe.orchestration import overrides as overrides_mod   # the flow's parameter `overrides` takes the module's name
from detpipe.orchestration.repair import repair
from detpipe.study import write_trial_file

STAGES = ("download", "convert", "augment", "train", "evaluate", "export")
DEFAULT_REPO = Path(__file__).resolve().parent.parent
REPO_ENV = "DETPIPE_REPO"  # the repository the flow works on, when the ``repo`` parameter is not given


def repository(repo: str | None) -> Path:
    """The repository a run works on: ``repo``, else ``$DETPIPE_REPO``, else the one holding this file; raises
    `detpipe.orchestration.workspace.WorkspaceError` unless it is a git+DVC repository with the pipeline's `STAGES`."""
    return workspace.resolve_repo(repo or os.environ.get(REPO_ENV) or DEFAULT_REPO, STAGES)


@task(name="stage", task_run_name="{stage}", retries=1, retry_delay_seconds=10, cache_policy=NO_CACHE,
      persist_result=False)
def repro_stage(stage: str, ws: str, sync: remotes.Run | None = None, push_every: int = 0) -> str:
    """Reproduce ``stage`` in workspace ``ws`` (`detpipe.orchestration.experiments.repro`; its upstream stages are the
    earlier tasks), after `detpipe.orchestration.repair.repair` undid what a killed DVC left; with ``sync`` also pull,
    push checkpoints every ``push_every`` while training, and push the outputs. Returns ``"ran"``,
    ``"restored"`` or ``"skipped"``. Raises `detpipe.orchestration.processes.CommandError`."""
    logger, ws = get_run_logger(), Path(ws)
    for note in repair(ws):
        logger.warning("repair: %s", note)
    pushing = remotes.pushing_checkpoints(ws, sync, push_every, logger) if sync and stage == "train" else None
    with pushing or contextlib.nullcontext():
        outcome = experiments.repro(ws, stage, logger, pull=bool(sync))
    if sync:
        remotes.push_stage(ws, stage, logger)
    return outcome


@task(name="experiment", task_run_name="exp-save-{name}", retries=1, cache_policy=NO_CACHE, persist_result=False)
def save_experiment(name: str, ws: str, sync: remotes.Run | None = None) -> str:
    """Save workspace ``ws`` as experiment ``name`` (`detpipe.orchestration.experiments.save`), with ``sync`` pushed
    (`detpipe.orchestration.remotes.push_experiment`); returns the experiment's git ref."""
    ref = experiments.save(Path(ws), name, get_run_logger())
    if sync:
        remotes.push_experiment(Path(ws), ref, sync.remotes, get_run_logger())
    return ref


@flow(name="train", persist_result=True)
def train(overrides: dict[str, Any] | None = None, repo: str | None = None, upto: str = "export",
          sync: bool = False, trial: dict | None = None, workspace_id: str | None = None) -> dict | None:
    """Run download → convert → augment → train → evaluate → export through DVC in an isolated workspace and
    save it as DVC experiment named after the flow run.

    Args:
        overrides: params.yaml overrides, ``{"train.lr": 0.01}`` (or ``{"train": {"lr": 0.01}}``).
        repo: repository to run in (default ``$DETPIPE_REPO``, else the one holding this file).
        upto: last stage to run; before ``export`` the run is no experiment (a sweep's shared stages).
        sync: pull from and push to the git remote ``origin`` and the default DVC remote (`detpipe.orchestration.remotes`);
            always on where ``$DETPIPE_SYNC`` is 1 (``--source`` deployments).
        trial: a search trial (`detpipe.orchestration.search.trial_spec`) the training reports its val AP to, written to
            the workspace's `detpipe.study.TRIAL_FILE` (neither a param nor an output).
        workspace_id: the workspace's folder name under ``.dvc/tmp/runs`` (default: the flow run id); a search
            names it after the trial, so a trial resumed by another search continues in the workspace it kept.
    Returns:
        `detpipe.orchestration.experiments.summarize`'s dict, also published as markdown artifact ``train-results``; None
        when ``upto`` stops early.
    Raises:
        StageError: bad overrides or repository, a remote missing or unreachable (`detpipe.orchestration.remotes.RemoteError`,
            before any work), or a stage failing after its retries.
    """
    if os.environ.get("PREFECT__FLOW_RUN_ID"):  # started by serve or a worker: die with it (see detpipe.orchestration.processes)
        lifeline.die_with_parent()
    logger = get_run_logger()
    root, overrides = repository(repo), overrides_mod.normalize(overrides)
    name, run_id = experiments.experiment_name(flow_run.get_name()), str(flow_run.get_id())
    syncing = sync or os.environ.get(remotes.SYNC_ENV) == "1"
    synced = remotes.Run(remotes.check(root), name, run_id) if syncing else None
    start = remotes.find_experiment(root, synced, logger) if synced else None
    stages: dict[str, str] = {}
    with (workspace.isolated(root, workspace_id or run_id, logger, start, bool(synced)) as ws,
          remotes.keeping(ws, synced, stages, logger)):
        overrides_mod.apply(ws / "params.yaml", overrides)
        if trial:
            logger.info("search trial %s of study %s: %s", trial["number"], trial["study"],
                        write_trial_file(ws, trial))
        logger.info("params.yaml overrides of this run: %s", overrides)
        cfg = params_mod.load("flows", path=ws / "params.yaml")
        stage = repro_stage.with_options(retries=cfg.retries, retry_delay_seconds=cfg.retry_delay_s)
        for s in STAGES[:STAGES.index(upto) + 1]:
            stages[s] = stage(s, str(ws), synced, cfg.push_checkpoints_every)
        if upto != STAGES[-1]:
            return None
        ref = save_experiment(name, str(ws), synced)
        result = experiments.summarize(ws, stages, name, ref, overrides, synced.remotes if synced else None,
                                         logger)
    create_markdown_artifact(key="train-results", markdown=experiments.markdown(result),
                             description=f"experiment {name}")
    logger.info("result: %s", json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.train [--param section.key=value ...] [--repo PATH]``: one flow run in this process.
    Exit status 0, 2 on bad overrides, 1 with a one-line ``error: ...`` when the run fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--param", "-p", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="params.yaml override for this run, e.g. train.lr=0.01 (repeatable)")
    parser.add_argument("--repo", default=None, help=f"repository (default ${REPO_ENV}, else this checkout)")
    parser.add_argument("--sync", action="store_true", help="pull from and push to the git and DVC remotes")
    args = parser.parse_args(argv)
    try:
        overrides = overrides_mod.parse(args.param)
    except overrides_mod.OverrideError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return report(train(overrides=overrides or None, repo=args.repo, sync=args.sync, return_state=True))


def report(state) -> int:
    """Print a finished flow run's result as JSON (exit status 0), or a one-line ``error: ...`` (1)."""
    if not state.is_completed():
        print(f"error: flow run {state.name}: {state.message}", file=sys.stderr)
        return 1
    print(json.dumps(state.result(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
