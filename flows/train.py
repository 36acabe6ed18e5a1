"""Prefect flow ``train``: the DVC pipeline, one task per stage, each run a DVC experiment in its own workspace.

``python -m flows.train [--param train.lr=0.01 ...] [--repo PATH]`` runs it once in this process; ``python -m
flows.serve`` serves it as deployment ``train/main``. A run works in a git worktree of the repository's commit
sharing its DVC cache (`detpipe.ops.workspace`), writes its overrides into that worktree's params.yaml
(`detpipe.ops.overrides`), runs ``dvc repro --single-item <stage>`` per stage task (DVC skips what is up to date;
commands bound to the run's life by `detpipe.ops.processes`) and saves the worktree as DVC experiment named after the
flow run (``dvc exp save``, with the ``cache: false`` metrics and plots ``dvc exp run`` would commit).

With ``sync`` (always in a ``--source`` deployment, whose clone is thrown away) the run also pulls from and
pushes to the team's remotes (`detpipe.ops.remotes`): it fails at once without them, continues an experiment of
its name an earlier attempt pushed, pushes each stage's outputs, training's checkpoints while it runs and what
it has when it fails, and ends with ``dvc exp push origin <name>``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from detpipe.ops import overrides as ov
from detpipe import params as params_mod
from detpipe.ops import remotes as rm
from detpipe import lifeline
from detpipe.ops import processes as runs
from detpipe.ops import workspace
from detpipe.ops.repair import repair

STAGES = ("download", "convert", "augment", "train", "evaluate", "export")
DEFAULT_REPO = Path(__file__).resolve().parent.parent
REPO_ENV = "DETPIPE_REPO"  # the repository the flow works on, when the ``repo`` parameter is not given


@task(name="stage", task_run_name="{stage}", retries=1, retry_delay_seconds=10, cache_policy=NO_CACHE,
      persist_result=False)
def run_stage(stage: str, ws: str, sync: rm.Run | None = None, push_every: int = 0) -> str:
    """``dvc repro --single-item <stage>`` in workspace ``ws`` (its upstream stages are the earlier tasks); with
    ``sync`` also ``--pull``, checkpoints pushed as partial experiment every ``push_every`` while training,
    and the outputs pushed afterwards. Returns ``"ran"``, ``"restored"`` (from DVC's run-cache) or
    ``"skipped"`` (up to date). Raises `runs.CommandError`.
    First `detpipe.ops.repair.repair` undoes what a killed DVC left (cut lock files, temporary folders)."""
    logger, ws = get_run_logger(), Path(ws)
    for note in repair(ws):
        logger.warning("repair: %s", note)
    pushing = rm.pushing_checkpoints(ws, sync, push_every, logger) if sync and stage == "train" else None
    with pushing or contextlib.nullcontext():
        lines = runs.run_logged(runs.dvc("repro", "--single-item", stage, *["--pull"] * bool(sync)), ws, logger)
    if sync:
        rm.push_stage(ws, stage, logger)
    if any(ln.startswith(f"Running stage '{stage}'") for ln in lines):
        return "ran"
    return "restored" if any("is cached - skipping run" in ln for ln in lines) else "skipped"


@task(name="experiment", task_run_name="exp-save-{name}", retries=1, cache_policy=NO_CACHE, persist_result=False)
def save_experiment(name: str, ws: str, sync: rm.Run | None = None) -> str:
    """``dvc exp save --name <name> --force`` (a retry replaces its own experiment) with the pipeline's
    untracked files, with ``sync`` pushed (`detpipe.ops.remotes.push_experiment`); returns the experiment's git ref."""
    args = ["exp", "save", "--name", name, "--force"]
    for path in workspace.untracked_pipeline_files(Path(ws)):
        args += ["--include-untracked", path]
    with workspace.experiment_lock(Path(ws)):
        runs.run_logged(runs.dvc(*args), Path(ws), get_run_logger())
    base = runs.run_logged(["git", "rev-parse", "HEAD"], Path(ws), get_run_logger())[-1]
    ref = f"refs/exps/{base[:2]}/{base[2:]}/{name}"
    if sync:
        rm.push_experiment(Path(ws), ref, sync.remotes, get_run_logger())
    return ref


def experiment_name(run_name: str | None) -> str:
    """A DVC experiment (git ref) name from a flow run name: other characters than ``[A-Za-z0-9_-]`` → ``-``."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", run_name or "").strip("-") or "prefect-run"


def summarize(ws: Path, stages: dict, experiment: str, ref: str, overrides: dict, sync: rm.Run | None) -> dict:
    """The run's result: experiment, git ref, overrides, what each stage did, COCO bbox metrics, and each
    cached output's md5 and where it is: with ``sync`` its URI in the DVC remote and the git remote's URL,
    else its file in the shared DVC cache (``<cache>/files/md5/ab/cdef…``)."""
    cache = Path(runs.run_logged(runs.dvc("cache", "dir"), ws, get_run_logger())[-1])
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    cached = set(workspace.pipeline_outs(ws, cached=True))
    outs = {o["path"]: o["md5"] for s in lock.values() for o in s.get("outs", []) if o["path"] in cached}
    files = {p: cache / "files" / "md5" / h[:2] / h[2:] for p, h in outs.items()}
    where = (lambda p: {"remote": sync.remotes.uri(outs[p])}) if sync else (lambda p: {"cache": str(files[p])})
    outputs = {p: {"md5": outs[p], **where(p)} for p, f in files.items() if f.is_file()}
    metrics = json.loads((ws / "metrics/eval.json").read_text()).get("bbox", {})
    remote = {"git_remote": sync.remotes.git_url, "dvc_remote": sync.remotes.dvc_url} if sync else {}
    return {"experiment": experiment, "ref": ref, **remote, "overrides": overrides, "stages": stages,
            "metrics": metrics, "outputs": outputs}


def _markdown(r: dict) -> str:
    get = f"`dvc exp pull origin {r['experiment']}` (git remote {r['git_remote']}) and " if "git_remote" in r else ""
    rows = [f"# Experiment `{r['experiment']}` (`{r['ref']}`)", "", f"Overrides `{json.dumps(r['overrides'])}`; "
            f"{get}`dvc exp apply {r['experiment']}` bring it into a workspace.", "", "| stage | DVC |", "|---|---|"]
    rows += [f"| {s} | {v} |" for s, v in r["stages"].items()] + ["", "| COCO bbox | value |", "|---|---|"]
    rows += [f"| {k} | {v:.4f} |" for k, v in r["metrics"].items()] + ["", "| output | md5 |", "|---|---|"]
    rows += [f"| {p} | {o['md5']} {o.get('remote', '')} |" for p, o in r["outputs"].items()]
    return "\n".join(rows) + "\n"


@flow(name="train", persist_result=True)
def train(overrides: dict[str, Any] | None = None, repo: str | None = None, upto: str = "export",
          sync: bool = False) -> dict | None:
    """Run download → convert → augment → train → evaluate → export through DVC in an isolated workspace and
    save it as DVC experiment named after the flow run.

    Args:
        overrides: params.yaml overrides, ``{"train.lr": 0.01}`` (or ``{"train": {"lr": 0.01}}``).
        repo: repository to run in (default ``$DETPIPE_REPO``, else the one holding this file).
        upto: last stage to run; before ``export`` the run is no experiment (a sweep's shared stages).
        sync: pull from and push to the git remote ``origin`` and the default DVC remote (`detpipe.ops.remotes`);
            always on where ``$DETPIPE_SYNC`` is 1 (``--source`` deployments).
    Returns:
        `summarize`'s dict, also published as markdown artifact ``train-results``; None when ``upto`` stops
        early.
    Raises:
        StageError: bad overrides or repository, a remote missing or unreachable (`detpipe.ops.remotes.RemoteError`,
            before any work), or a stage failing after its retries.
    """
    if os.environ.get("PREFECT__FLOW_RUN_ID"):  # started by serve or a worker: die with it (see detpipe.ops.processes)
        lifeline.die_with_parent()
    logger = get_run_logger()
    root = workspace.resolve_repo(repo or os.environ.get(REPO_ENV) or DEFAULT_REPO, STAGES)
    overrides = ov.normalize(overrides)
    name, run_id = experiment_name(flow_run.get_name()), str(flow_run.get_id())
    syncing = sync or os.environ.get(rm.SYNC_ENV) == "1"
    synced = rm.Run(rm.check(root), name, run_id) if syncing else None
    start = rm.find_experiment(root, synced, logger) if synced else None
    stages: dict[str, str] = {}
    with workspace.isolated(root, run_id, logger, start, bool(synced)) as ws, rm.keeping(ws, synced, stages, logger):
        ov.apply(ws / "params.yaml", overrides)
        logger.info("params.yaml overrides of this run: %s", overrides)
        cfg = params_mod.load("flows", path=ws / "params.yaml")
        stage = run_stage.with_options(retries=cfg.retries, retry_delay_seconds=cfg.retry_delay_s)
        for s in STAGES[:STAGES.index(upto) + 1]:
            stages[s] = stage(s, str(ws), synced, cfg.push_checkpoints_every)
        if upto != STAGES[-1]:
            return None
        result = summarize(ws, stages, name, save_experiment(name, str(ws), synced), overrides, synced)
    create_markdown_artifact(key="train-results", markdown=_markdown(result), description=f"experiment {name}")
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
        overrides = ov.parse(args.param)
    except ov.OverrideError as e:
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
