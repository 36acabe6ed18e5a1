"""A flow run's DVC side: one stage reproduced (``dvc repro --single-item``) and what DVC did with it, the
workspace saved as DVC experiment (``dvc exp save``), and the run's result read from ``dvc.lock`` (by DVC).

An experiment is a git commit whose parent is the run's *baseline* (the workspace's ``HEAD``), under the ref
``refs/exps/<baseline[:2]>/<baseline[2:]>/<name>`` (`experiment_ref`: DVC's layout, used for finished runs here and
for partial ones by `detpipe.orchestration.remotes`); its name comes from the flow run's (`experiment_name`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

from detpipe.orchestration import workspace
from detpipe.orchestration.processes import dvc, git, run_logged



class RemoteURIs(Protocol):
    """What `summarize` needs of a run's remotes (`detpipe.orchestration.remotes.Remotes` has it; not imported here:
    remotes imports this module)."""
    git_url: str
    dvc_url: str

    def uri(self, md5: str) -> str:
        """The DVC remote's URI of the cached output with this md5."""

FALLBACK_NAME = "prefect-run"    # the experiment name of a flow run whose name has no usable character


def experiment_name(run_name: str | None) -> str:
    """A DVC experiment (git ref) name from a flow run name: other characters than ``[A-Za-z0-9_-]`` → ``-``;
    `FALLBACK_NAME` when nothing is left."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", run_name or "").strip("-") or FALLBACK_NAME


def baseline(ws: Path) -> str:
    """The commit sha that workspace ``ws``'s experiments hang off (its ``HEAD``).
    Raises `subprocess.CalledProcessError` when ``ws`` is no git worktree."""
    return git(ws, "rev-parse", "HEAD").stdout.strip()


def experiment_ref(baseline_sha: str, name: str) -> str:
    """The git ref of experiment ``name`` of baseline commit ``baseline_sha``:
    ``refs/exps/<sha[:2]>/<sha[2:]>/<name>`` (where ``dvc exp save`` puts it and ``dvc exp pull`` looks)."""
    return f"refs/exps/{baseline_sha[:2]}/{baseline_sha[2:]}/{name}"


def repro_outcome(stage: str, lines: list[str]) -> str:
    """What ``dvc repro`` did with ``stage``, from its output ``lines``: ``"ran"``, ``"restored"`` (from DVC's
    run-cache) or ``"skipped"`` (up to date)."""
    if any(ln.startswith(f"Running stage '{stage}'") for ln in lines):
        return "ran"
    return "restored" if any("is cached - skipping run" in ln for ln in lines) else "skipped"


def repro(ws: Path, stage: str, logger, pull: bool = False) -> str:
    """``dvc repro --single-item <stage>`` (with ``pull``: ``--pull``, fetching missing inputs and run-cache
    entries from the default DVC remote) in workspace ``ws``, its output logged line by line; returns
    `repro_outcome`. Raises `detpipe.orchestration.processes.CommandError` when DVC fails."""
    lines = run_logged(dvc("repro", "--single-item", stage, *["--pull"] * pull), ws, logger)
    return repro_outcome(stage, lines)


def save(ws: Path, name: str, logger) -> str:
    """Save workspace ``ws`` as experiment ``name``: ``dvc exp save --name <name> --force`` (a retry replaces its
    own experiment) with the pipeline's untracked files (`detpipe.orchestration.workspace.untracked_pipeline_files`), one
    saving at a time per repository (`detpipe.orchestration.workspace.experiment_lock`). Returns the experiment's git ref
    (`experiment_ref`). Raises `detpipe.orchestration.processes.CommandError` when DVC fails."""
    args = ["exp", "save", "--name", name, "--force"]
    for path in workspace.untracked_pipeline_files(ws):
        args += ["--include-untracked", path]
    with workspace.experiment_lock(ws):
        run_logged(dvc(*args), ws, logger)
    return experiment_ref(baseline(ws), name)


def summarize(ws: Path, stages: dict[str, str], experiment: str, ref: str, overrides: dict,
              remotes: RemoteURIs | None, logger) -> dict:
    """The result of the run in workspace ``ws``: experiment, git ref, overrides, what each stage did
    (``stages``), COCO bbox metrics (``metrics/eval.json``), and each cached output's md5 and where it is: with
    ``remotes`` (a run that syncs) its URI in the DVC remote and the git remote's URL, else its file in the
    shared DVC cache (``<cache>/files/md5/ab/cdef…``). An output missing from the cache is left out.

    The md5s are those ``dvc.lock`` records, read by DVC (`detpipe.orchestration.workspace.locked_outs`).

    Raises:
        OSError: no ``dvc.lock`` or ``metrics/eval.json`` (the pipeline did not finish).
        dvc.exceptions.DvcException: DVC cannot read dvc.yaml or dvc.lock.
    """
    cache = workspace.cache_dir(ws)
    outs = workspace.locked_outs(ws)
    files = {p: cache / "files" / "md5" / h[:2] / h[2:] for p, h in outs.items()}
    where = (lambda p: {"remote": remotes.uri(outs[p])}) if remotes else (lambda p: {"cache": str(files[p])})
    outputs = {p: {"md5": outs[p], **where(p)} for p, f in files.items() if f.is_file()}
    metrics = json.loads((ws / "metrics/eval.json").read_text()).get("bbox", {})
    remote = {"git_remote": remotes.git_url, "dvc_remote": remotes.dvc_url} if remotes else {}
    return {"experiment": experiment, "ref": ref, **remote, "overrides": overrides, "stages": stages,
            "metrics": metrics, "outputs": outputs}


def markdown(result: dict) -> str:
    """`summarize`'s ``result`` as markdown: how to get the experiment, then tables of the stages, the COCO bbox
    metrics and the outputs."""
    r = result
    get = f"`dvc exp pull origin {r['experiment']}` (git remote {r['git_remote']}) and " if "git_remote" in r else ""
    rows = [f"# Experiment `{r['experiment']}` (`{r['ref']}`)", "", f"Overrides `{json.dumps(r['overrides'])}`; "
            f"{get}`dvc exp apply {r['experiment']}` bring it into a workspace.", "", "| stage | DVC |", "|---|---|"]
    rows += [f"| {s} | {v} |" for s, v in r["stages"].items()] + ["", "| COCO bbox | value |", "|---|---|"]
    rows += [f"| {k} | {v:.4f} |" for k, v in r["metrics"].items()] + ["", "| output | md5 |", "|---|---|"]
    rows += [f"| {p} | {o['md5']} {o.get('remote', '')} |" for p, o in r["outputs"].items()]
    return "\n".join(rows) + "\n"
