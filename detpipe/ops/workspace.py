"""Isolated experiment workspaces: each flow run works in a git worktree of the repository's current commit,
sharing the repository's DVC cache, so the user's workspace is never changed by a run.

A run's workspace is ``<repo>/.dvc/tmp/runs/<flow run id>`` (inside ``.dvc/tmp``: ignored by git and DVC). It
starts from ``HEAD`` plus the user's current ``dvc.lock`` and ``cache: false`` outputs (metrics, plots), and
``dvc checkout`` links the cached outputs in, so DVC skips every stage already computed with the same params.
It is removed when the run ends successfully or is cancelled; a failed or crashed run's workspace (with its
checkpoints) is kept, and a retry of the same flow run (same id) continues in it and removes it when it
succeeds. ``git worktree list`` shows kept ones; ``git worktree remove --force <path>`` deletes one.

A run that syncs with the team's remotes (`detpipe.ops.remotes`) can instead start from an experiment commit an
earlier attempt pushed: the workspace is then a worktree of that experiment's baseline with the experiment's
files (params.yaml, dvc.lock, metrics) on top, as ``dvc exp apply`` leaves them, and ``dvc pull
--allow-missing`` fetches every output ``dvc.lock`` records (the checkpoints of a partial training included).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import yaml

from detpipe.errors import StageError
from detpipe.ops.processes import dvc, git, run_logged

RUNS_DIR = ".dvc/tmp/runs"


class WorkspaceError(StageError):
    """The repository cannot host a run (no DVC repository, stages differ, no git commit); one line."""


def resolve_repo(repo: str | os.PathLike, stages: tuple[str, ...]) -> Path:
    """``repo`` as an absolute path, checked to be a git+DVC repository whose ``dvc.yaml`` defines ``stages``.

    Raises:
        WorkspaceError: not a DVC repository, other stages, or no git commit to start a run from.
    """
    root = Path(repo).expanduser().resolve()
    dvc_yaml = root / "dvc.yaml"
    if not dvc_yaml.is_file() or not (root / ".dvc").is_dir():
        raise WorkspaceError(f"{root}: not a DVC repository with a dvc.yaml")
    found = list((yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {})
    if sorted(found) != sorted(stages):
        raise WorkspaceError(f"{dvc_yaml}: stages {found} differ from the flow's {list(stages)}")
    if git(root, "rev-parse", "--verify", "-q", "HEAD", check=False).returncode:
        raise WorkspaceError(f"{root}: a run is a DVC experiment, which needs a git commit to start from "
                             "(git init && git add -A && git commit)")
    return root


def pipeline_outs(root: Path, cached: bool) -> list[str]:
    """Paths (relative to ``root``) of the pipeline's outputs stored in DVC's cache (``cached``) or in git
    (``cache: false`` metrics and plots)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return sorted({os.path.relpath(o.fs_path, root) for o in repo.index.outs if o.use_cache == cached})


def untracked_pipeline_files(root: Path) -> list[str]:
    """Untracked files that ``dvc exp run`` would commit with an experiment but ``dvc exp save`` needs
    ``--include-untracked`` for: ``cache: false`` outputs and the ``.gitignore`` files DVC writes beside
    cached outputs."""
    paths = set(pipeline_outs(root, cached=False))
    paths |= {os.path.join(os.path.dirname(p), ".gitignore") for p in pipeline_outs(root, cached=True)}
    out = git(root, "ls-files", "-z", "--others", "--exclude-standard", "--", *sorted(paths)).stdout
    return sorted(filter(None, out.split("\0")))


def add_worktree(repo: Path, path: Path, rev: str = "HEAD") -> None:
    """A detached git worktree of ``repo`` (a repository or one of its worktrees) at ``rev`` in ``path``, whose
    DVC cache is ``repo``'s.

    Raises:
        subprocess.CalledProcessError: git or DVC failed.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    git(repo, "worktree", "add", "--detach", str(path), rev)
    cache = subprocess.run(dvc("cache", "dir"), cwd=repo, capture_output=True, text=True, check=True).stdout
    subprocess.run(dvc("config", "--local", "cache.dir", str((repo / cache.strip()).resolve())), cwd=path,
                   check=True, capture_output=True)


def _create(root: Path, ws: Path, logger, experiment: str | None, pull: bool) -> None:
    if experiment:
        add_worktree(root, ws, f"{experiment}^")
        git(ws, "restore", f"--source={experiment}", "--worktree", "--", ".")
        logger.info("workspace starts from experiment commit %s (files as `dvc exp apply` leaves them)", experiment)
        run_logged(dvc("pull" if pull else "checkout", "--allow-missing"), ws, logger)
        return
    add_worktree(root, ws)
    for rel in ["dvc.lock", *pipeline_outs(root, cached=False)]:
        src = root / rel
        if src.is_dir():
            shutil.copytree(src, ws / rel, dirs_exist_ok=True)
        elif src.is_file():
            (ws / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, ws / rel)
    if (ws / "dvc.lock").is_file():
        run_logged(dvc("checkout", "--allow-missing"), ws, logger)


def experiment_lock(ws: Path):
    """A lock (``filelock.FileLock``, held with ``with``) shared by all worktrees of ``ws``'s repository, for
    ``dvc exp save``: DVC stages an experiment commit through refs shared by every worktree
    (``refs/exps/exec/...``), so two runs saving at once in one repository could swap their experiments."""
    from filelock import FileLock

    common = git(ws, "rev-parse", "--git-common-dir").stdout.strip()
    return FileLock(str((ws / common).resolve() / "detpipe-exp-save.lock"))


def remove(root: Path, ws: Path) -> None:
    """Delete workspace ``ws`` of repository ``root`` (worktree and its files)."""
    git(root, "worktree", "remove", "--force", str(ws), check=False)
    shutil.rmtree(ws, ignore_errors=True)
    git(root, "worktree", "prune", check=False)


@contextlib.contextmanager
def isolated(root: Path, run_id: str, logger, experiment: str | None = None, pull: bool = False) -> Iterator[Path]:
    """The workspace of flow run ``run_id`` for the block (created, or the one its failed attempt kept);
    removed afterwards unless the block raised an `Exception` (see the module docstring).

    Args:
        experiment: sha of an experiment commit (present in ``root``) a new workspace starts from.
        pull: with ``experiment``, ``dvc pull --allow-missing`` what its ``dvc.lock`` records.

    Raises:
        subprocess.CalledProcessError: git or DVC could not create it.
    """
    ws = root / RUNS_DIR / run_id
    if (ws / ".git").exists():
        logger.info("continuing in the workspace an earlier attempt of this run kept: %s", ws)
    else:
        remove(root, ws)
        _create(root, ws, logger, experiment, pull)
        logger.info("isolated workspace for this run: %s (git worktree of %s, DVC cache shared)", ws, root)
    try:
        yield ws
    except Exception:
        logger.warning("workspace %s is kept for a retry of this run (prefect flow-run retry <id>)", ws)
        raise
    except BaseException:
        remove(root, ws)
        raise
    remove(root, ws)
