"""Prefect flow ``train``: the DVC pipeline, one Prefect task per stage, with DVC deciding what is up to date.

Run it once in-process: ``python -m flows.train [--param train.lr=0.01 ...] [--repo PATH]``; serve it as
deployment ``train/main`` with ``python -m flows.serve`` and trigger it with
``prefect deployment run train/main --params '{"overrides": {"train.lr": 0.01}}' --watch``.

Design (DVC 3.67, Prefect 3.8):

* **One task per stage.** Task ``stage`` runs ``dvc --wait-for-lock repro --single-item <stage>`` in the
  repository, for download, convert, augment, train, evaluate, export in pipeline order, and streams every
  output line (DVC's and the stage's) into the Prefect run log. Prefect's task caching is off
  (``cache_policy=NO_CACHE``): ``dvc repro`` and the flow share DVC's cache, and a stage DVC finds up to date is
  skipped by DVC ("Stage 'x' didn't change, skipping"), whoever ran it before. ``flows.retries`` /
  ``flows.retry_delay_s`` (params.yaml) set each stage task's retries.
* **Every run is a DVC experiment** named after the flow run. DVC documents ``dvc exp run`` as "equivalent to
  ``dvc repro`` followed by ``dvc exp save``", with ``-S key=value`` editing params.yaml first
  (https://dvc.org/doc/command-reference/exp/run); the flow does the same steps, split per stage: it writes the
  run's overrides into params.yaml (round-trip YAML: comments kept; the result is validated by
  ``detpipe.params`` before anything runs), runs the stage tasks, then ``dvc exp save --name <run> --force``. Like
  ``dvc exp run``, the saved experiment includes the pipeline's untracked git-side files (``cache: false``
  metrics and plots, DVC's ``.gitignore`` files), which ``dvc exp save`` only takes with
  ``--include-untracked``. Rejected: ``dvc exp run <stage> -S ...`` per task (one experiment per stage, name
  clashes) and one ``dvc exp run`` task (no per-stage retries, logs or resume granularity).
* **params.yaml is put back** after the run, failed or not (a copy waits in ``.dvc/tmp/flows/`` until then; a
  run killed outright is cleaned up by the next run), so each run is "the repository's params.yaml + this
  run's overrides". The run's outputs stay in the workspace, as after ``dvc exp run``; ``dvc exp apply <name>``
  brings any run's params and outputs back.
* **Concurrent runs are serialized**: a run holds an exclusive lock on ``.dvc/tmp/flow.lock`` (``filelock``,
  released by the kernel if the process dies) from before params are written until they are put back. A second
  run on the same repository logs which run holds it and waits, then runs: it never fails halfway. Stage
  commands also pass ``--wait-for-lock`` so a manual ``dvc repro`` in the same repository makes a stage wait
  instead of failing on DVC's lock. If a run's process dies outright (SIGKILL, OOM), the next run that gets
  the lock kills what is left of the commands it started (their process sessions are recorded beside the lock)
  and puts params.yaml back before doing anything else.
* **Resume after failure**: DVC keeps the stages that finished and the train stage's checkpoints
  (``persist: true``); a new run or ``prefect flow-run retry`` re-runs the tasks, DVC skips what is up to date,
  and the train stage resumes from its newest matching checkpoint (``train.resume: auto``).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import yaml
from filelock import FileLock, Timeout
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from detpipe import params as params_mod
from detpipe.errors import StageError
from detpipe.io import atomic_write_bytes

STAGES = ("download", "convert", "augment", "train", "evaluate", "export")
DEFAULT_REPO = Path(__file__).resolve().parent.parent
REPO_ENV = "DETPIPE_REPO"          # the repository the flow works on, when the ``repo`` parameter is not given
PARAMS = "params.yaml"
LOCK = ".dvc/tmp/flow.lock"
LOCK_OWNER = ".dvc/tmp/flow.lock.owner"
PARAMS_BACKUP = ".dvc/tmp/flows/params.yaml.orig"
WAIT_LOG_EVERY_S = 60.0            # while queued behind another run, how often to say so
# What the flow run's result points at (paths relative to the repository).
OUTPUTS = {"metrics": "metrics/eval.json", "model": "models/model.pt", "exported_program": "models/torch_export/model.pt2",
           "onnx": "models/model.onnx", "export_report": "models/export_report.json",
           "training_metrics": "dvclive/metrics.json", "pr_curve": "plots/pr_curve.json"}


class FlowError(StageError):
    """A failed orchestration step (bad override, locked or broken repository, failed command); one line."""


# ---------------------------------------------------------------------------------------------- repository

def resolve_repo(repo: str | os.PathLike | None = None) -> Path:
    """The repository the flow works on: ``repo``, else ``$DETPIPE_REPO``, else this file's repository.

    Raises:
        FlowError: it has no ``dvc.yaml``, or ``dvc.yaml`` does not define exactly the stages in `STAGES`.
    """
    root = Path(repo or os.environ.get(REPO_ENV) or DEFAULT_REPO).expanduser().resolve()
    dvc_yaml = root / "dvc.yaml"
    if not dvc_yaml.is_file() or not (root / ".dvc").is_dir():
        raise FlowError(f"{root}: not a DVC repository with a dvc.yaml (set the 'repo' parameter or ${REPO_ENV})")
    stages = list((yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {})
    if sorted(stages) != sorted(STAGES):
        raise FlowError(f"{dvc_yaml}: stages {stages} differ from the flow's {list(STAGES)} (update flows/train.py)")
    return root


def child_env() -> dict[str, str]:
    """Environment for DVC and the stages: this interpreter's ``bin`` first on ``PATH`` (so the stages'
    ``python -m ...`` commands use the same environment), unbuffered output, telemetry off."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["DVC_NO_ANALYTICS"] = "1"
    env.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    return env


def run_logged(cmd: list[str], cwd: Path, logger) -> list[str]:
    """Run ``cmd`` in ``cwd`` and send each line of its stdout+stderr to ``logger`` as it comes.

    The command runs in its own session (recorded beside the repository's flow lock, see `repo_lock`); if
    this process is interrupted (Prefect cancellation, Ctrl-C) the session's process group gets SIGTERM, then
    SIGKILL after 10 s, so no stage keeps running unobserved.
    Returns:
        the output lines.
    Raises:
        FlowError: non-zero exit status; the message quotes the command's ``error:``/``ERROR:`` lines.
    """
    logger.info("$ %s", " ".join(cmd))
    lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
    _note_session(cwd, proc.pid, running=True)  # start_new_session: its session id is its pid
    try:
        for line in proc.stdout:
            line = line.rstrip()
            if line.strip():
                lines.append(line)
                logger.info("%s", line)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            _stop_group(proc)
        _note_session(cwd, proc.pid, running=False)
    if rc:
        errors = [ln.strip() for ln in lines if ln.lstrip().lower().startswith("error")]
        detail = "; ".join(errors[-3:]) or (lines[-1] if lines else "no output")
        raise FlowError(f"`{' '.join(cmd)}` exited with status {rc}: {detail}")
    return lines


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def dvc(*args: str) -> list[str]:
    """``dvc --wait-for-lock <args>`` run with this interpreter (``python -m dvc``)."""
    return [sys.executable, "-m", "dvc", "--wait-for-lock", *args]


def git_head(root: Path) -> str | None:
    """The commit ``HEAD`` points at in ``root``, or None (not a git repository, or no commit yet)."""
    proc = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=root, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


# ---------------------------------------------------------------------------------------------- overrides

def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["train.lr=0.01", "train.milestones=[0.5, 0.8]"]`` → ``{"train.lr": 0.01, ...}``; each value is
    read as YAML (numbers, booleans, null, lists; anything else stays a string).

    Raises:
        FlowError: an item without ``=``.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FlowError(f"override '{item}': expected section.key=value, e.g. train.lr=0.01")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


def normalize_overrides(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Flatten ``{"train": {"lr": 0.01}}`` to ``{"train.lr": 0.01}``; dotted keys pass through.

    Raises:
        FlowError: a key that is not ``section.key`` for a section and key of params.yaml's schema
            (`detpipe.params.Params`).
    """
    flat: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if "." not in key and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    sections = params_mod.Params.model_fields
    for key in flat:
        section, _, name = key.partition(".")
        if section not in sections or name not in sections[section].annotation.model_fields:
            raise FlowError(f"override '{key}': not a params.yaml key (expected section.key, e.g. train.lr; "
                            f"sections: {', '.join(sections)})")
    return flat


def _yaml_rt():
    from ruamel.yaml import YAML

    rt = YAML()  # round trip: comments and layout of untouched keys are kept
    rt.preserve_quotes = True
    rt.width = 4096
    rt.representer.add_representer(
        type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))  # not an empty value
    return rt


def apply_overrides(params_file: Path, overrides: dict[str, Any]) -> bytes:
    """Write ``overrides`` (``{"section.key": value}``) into ``params_file``, keeping its comments, after
    checking that the result passes `detpipe.params.load`. Returns the file's previous bytes.

    Raises:
        FlowError: the overridden params break the schema (the message names the key and value); the file is
            then left unchanged.
    """
    from ruamel.yaml.comments import CommentedSeq

    original = params_file.read_bytes()
    rt = _yaml_rt()
    data = rt.load(original.decode())
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if isinstance(value, list):
            value = CommentedSeq(value)
            value.fa.set_flow_style()
        data[section][name] = value
    with tempfile.TemporaryDirectory() as tmp:
        candidate = Path(tmp) / params_file.name
        with open(candidate, "w") as f:
            rt.dump(data, f)
        try:
            params_mod.load(path=candidate)
        except StageError as e:
            raise FlowError(f"overrides {overrides}: {str(e).replace(str(candidate), params_file.name)}") from None
        atomic_write_bytes(params_file, candidate.read_bytes())
    return original


@contextlib.contextmanager
def overridden_params(root: Path, overrides: dict[str, Any], logger) -> Iterator[None]:
    """params.yaml with ``overrides`` applied for the duration of the block, then put back (a backup in
    ``.dvc/tmp/flows/`` survives a killed process; `restore_stale_params` uses it)."""
    if not overrides:
        yield
        return
    params_file, backup = root / PARAMS, root / PARAMS_BACKUP
    atomic_write_bytes(backup, params_file.read_bytes())
    try:
        apply_overrides(params_file, overrides)
        logger.info("params.yaml overrides for this run: %s", overrides)
        yield
    finally:
        atomic_write_bytes(params_file, backup.read_bytes())
        backup.unlink()
        logger.info("params.yaml put back as it was before the run")


def restore_stale_params(root: Path, logger) -> None:
    """Put back params.yaml from the backup a killed run left in ``.dvc/tmp/flows/`` (no-op without one)."""
    backup = root / PARAMS_BACKUP
    if backup.is_file():
        logger.warning("an interrupted flow run left params.yaml overridden; restoring it from %s", PARAMS_BACKUP)
        atomic_write_bytes(root / PARAMS, backup.read_bytes())
        backup.unlink()


# ---------------------------------------------------------------------------------------------- lock

# Repositories whose flow lock this process holds: root -> owner file (see `repo_lock`, `_note_session`).
_HELD: dict[str, Path] = {}


@contextlib.contextmanager
def repo_lock(root: Path, logger, who: str) -> Iterator[None]:
    """Hold the repository's flow lock (``.dvc/tmp/flow.lock``) for the block; while another run holds it,
    wait, saying which run that is (logged once, then every `WAIT_LOG_EVERY_S` seconds).

    The owner file beside the lock names the run and the process sessions of the commands it started; a run
    that finds one after getting the lock knows its holder died without cleaning up (e.g. SIGKILL of the flow
    process) and first kills those sessions' leftover processes (a stage still running, or stopped), so
    they cannot write outputs beside this run's.
    """
    lock_path = root / LOCK
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    owner_file = root / LOCK_OWNER
    start = time.monotonic()
    try:
        lock.acquire(timeout=0)
    except Timeout:
        owner = _read_owner(owner_file)
        holder = (f"flow run '{owner.get('run')}' (pid {owner.get('pid')}, since {owner.get('since')})"
                  if owner else "another flow run")
        logger.warning("repository %s is busy: %s holds %s; this run is queued and waits for it", root, holder, LOCK)
        while True:
            try:
                lock.acquire(timeout=WAIT_LOG_EVERY_S)
                break
            except Timeout:
                logger.info("still waiting for %s (%.0f s)", LOCK, time.monotonic() - start)
        logger.info("got %s after waiting %.1f s", LOCK, time.monotonic() - start)
    try:
        stale = _read_owner(owner_file)
        if stale:
            _kill_leftovers(root, stale, logger)
        _write_owner(owner_file, {"run": who, "pid": os.getpid(),
                                  "since": dt.datetime.now().isoformat(timespec="seconds"), "sessions": []})
        _HELD[str(root)] = owner_file
        yield
    finally:
        _HELD.pop(str(root), None)
        with contextlib.suppress(OSError):
            owner_file.unlink()
        lock.release()


def _read_owner(owner_file: Path) -> dict:
    try:
        return json.loads(owner_file.read_text())
    except (OSError, ValueError):
        return {}


def _write_owner(owner_file: Path, owner: dict) -> None:
    atomic_write_bytes(owner_file, json.dumps(owner).encode())


def _note_session(cwd: Path, sid: int, running: bool) -> None:
    """Add (``running``) or remove a command's session id in the owner file of the lock held on ``cwd``."""
    owner_file = _HELD.get(str(Path(cwd).resolve()))
    if owner_file is None:
        return
    owner = _read_owner(owner_file)
    sessions = set(owner.get("sessions", []))
    sessions = sessions | {sid} if running else sessions - {sid}
    _write_owner(owner_file, {**owner, "sessions": sorted(sessions)})


def _kill_leftovers(root: Path, owner: dict, logger) -> None:
    """SIGKILL the processes still running (or stopped) in the sessions a dead flow run recorded, if their
    working directory is inside ``root`` (guards against reused ids)."""
    import psutil

    sessions = set(owner.get("sessions", []))
    victims = []
    for proc in psutil.process_iter(["cwd"]):
        try:
            cwd = proc.info["cwd"]
            if sessions and os.getsid(proc.pid) in sessions and cwd and Path(cwd).is_relative_to(root):
                victims.append(proc)
        except (OSError, psutil.Error):
            continue
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(victims, timeout=30)
    logger.warning("flow run '%s' (pid %s) ended without releasing %s cleanly; killed %d leftover process(es) "
                   "it had started", owner.get("run"), owner.get("pid"), LOCK, len(victims))


# ---------------------------------------------------------------------------------------------- tasks

@task(name="stage", task_run_name="{stage}", cache_policy=NO_CACHE, persist_result=False)
def run_stage(stage: str, repo: str) -> str:
    """Reproduce one DVC stage in ``repo`` (``dvc repro --single-item``: its upstream stages are the earlier
    tasks). Returns ``"ran"``, or ``"skipped"`` when DVC found it up to date.

    Raises:
        FlowError: DVC or the stage failed (Prefect retries the task per ``flows.retries``).
    """
    lines = run_logged(dvc("repro", "--single-item", stage), Path(repo), get_run_logger())
    return "ran" if any(ln.startswith(f"Running stage '{stage}'") for ln in lines) else "skipped"


def untracked_pipeline_files(root: Path) -> list[str]:
    """Untracked files (relative paths) that ``dvc exp run`` would commit with an experiment but
    ``dvc exp save`` needs ``--include-untracked`` for: ``cache: false`` outputs (metrics, plots) and the
    ``.gitignore`` files DVC writes beside cached outputs."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        outs = list(repo.index.outs)
    paths = {os.path.relpath(o.fs_path, root) for o in outs if not o.use_cache}
    paths |= {os.path.relpath(Path(o.fs_path).parent / ".gitignore", root) for o in outs if o.use_cache}
    proc = subprocess.run(["git", "ls-files", "-z", "--others", "--exclude-standard", "--", *sorted(paths)],
                          cwd=root, capture_output=True, text=True, check=True)
    return sorted(filter(None, proc.stdout.split("\0")))


@task(name="experiment", task_run_name="exp-save-{name}", cache_policy=NO_CACHE, persist_result=False)
def save_experiment(name: str, repo: str) -> str:
    """``dvc exp save --name <name> --force`` (a retried flow run replaces its own experiment) with the
    pipeline's untracked files. Returns the experiment name."""
    root = Path(repo)
    args = ["exp", "save", "--name", name, "--force"]
    for path in untracked_pipeline_files(root):
        args += ["--include-untracked", path]
    run_logged(dvc(*args), root, get_run_logger())
    return name


# ---------------------------------------------------------------------------------------------- flow

def experiment_name(run_name: str | None) -> str:
    """A DVC experiment (git ref) name from a flow run name: runs of characters other than letters, digits,
    ``_`` and ``-`` become ``-``."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", run_name or "").strip("-") or "prefect-run"


def summarize(root: Path, stages: dict[str, str], experiment: str | None, overrides: dict[str, Any]) -> dict:
    """The flow run's result: repository, experiment, overrides, what each stage did, absolute paths of
    the metrics and models (`OUTPUTS`, those that exist) and the COCO bbox metrics."""
    paths = {k: str(root / rel) for k, rel in OUTPUTS.items() if (root / rel).exists()}
    metrics = {}
    with contextlib.suppress(OSError, ValueError):
        metrics = json.loads((root / OUTPUTS["metrics"]).read_text()).get("bbox", {})
    return {"repo": str(root), "experiment": experiment, "overrides": overrides, "stages": stages,
            "paths": paths, "metrics": metrics}


def _markdown(result: dict) -> str:
    rows = [f"# Pipeline run `{result['experiment'] or '-'}`", "",
            f"Repository `{result['repo']}`; overrides `{json.dumps(result['overrides'])}`.", "",
            "| stage | DVC |", "|---|---|"]
    rows += [f"| {s} | {r} |" for s, r in result["stages"].items()]
    rows += ["", "| output | path |", "|---|---|"]
    rows += [f"| {k} | [{p}](file://{p}) |" for k, p in result["paths"].items()]
    if result["metrics"]:
        rows += ["", "| COCO bbox | value |", "|---|---|"]
        rows += [f"| {k} | {v:.4f} |" if isinstance(v, (int, float)) else f"| {k} | {v} |"
                 for k, v in result["metrics"].items()]
    return "\n".join(rows) + "\n"


@flow(name="train", persist_result=True)
def train(overrides: dict[str, Any] | None = None, repo: str | None = None) -> dict:
    """Run download → convert → augment → train → evaluate → export through DVC and save the run as DVC
    experiment named after the flow run.

    Args:
        overrides: params.yaml overrides for this run, ``{"train.lr": 0.01}`` (or ``{"train": {"lr": 0.01}}``).
        repo: repository to run in (default ``$DETPIPE_REPO``, else the one holding this file).
    Returns:
        `summarize`'s dict: experiment name, per-stage ``ran``/``skipped``, absolute paths of metrics and
        models, COCO bbox metrics. The same is published as markdown artifact ``train-results``.
    Raises:
        FlowError: bad overrides, no git commit to base the experiment on, or a stage failing after its retries.
    """
    logger = get_run_logger()
    root = resolve_repo(repo)
    overrides = normalize_overrides(overrides)
    run_name = flow_run.get_name() or "prefect-run"
    head = git_head(root)
    name = experiment_name(run_name) if head else None
    if not head:
        if overrides:
            raise FlowError(f"{root}: a run with overrides is a DVC experiment, which needs a git commit to "
                            "start from (git init && git add -A && git commit)")
        logger.warning("%s has no git commit: this run is not saved as a DVC experiment", root)
    stages: dict[str, str] = {}
    with repo_lock(root, logger, run_name):
        restore_stale_params(root, logger)
        with overridden_params(root, overrides, logger):
            cfg = params_mod.load("flows", path=root / PARAMS)
            stage_task = run_stage.with_options(retries=cfg.retries, retry_delay_seconds=cfg.retry_delay_s)
            for stage in STAGES:
                stages[stage] = stage_task(stage, str(root))
            if name:
                save_experiment(name, str(root))
    result = summarize(root, stages, name, overrides)
    create_markdown_artifact(key="train-results", markdown=_markdown(result),
                             description=f"metrics and model paths of run {run_name}")
    logger.info("result: %s", json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.train [--param section.key=value ...] [--repo PATH]``: one flow run in this process
    (against ``PREFECT_API_URL``, or a temporary local Prefect server). Exit status 0, or 1 with a one-line
    ``error: ...`` when the run fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--param", "-p", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="params.yaml override for this run, e.g. train.lr=0.01 (repeatable)")
    parser.add_argument("--repo", default=None, help=f"repository (default ${REPO_ENV}, else this checkout)")
    args = parser.parse_args(argv)
    try:
        overrides = normalize_overrides(parse_overrides(args.param))
    except FlowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    state = train(overrides=overrides or None, repo=args.repo, return_state=True)
    if not state.is_completed():
        print(f"error: flow run {state.name}: {state.message}", file=sys.stderr)
        return 1
    print(json.dumps(state.result(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
