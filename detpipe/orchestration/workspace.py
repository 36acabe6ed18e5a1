"""Isolated experiment workspaces: each flow run works in a git worktree of the repository's current commit,
sharing the repository's DVC cache, so the user's workspace is never changed by a run.

A run's workspace is ``<repo>/.dvc/tmp/runs/<flow run id>`` (inside ``.dvc/tmp``: ignored by git and DVC). It
starts from ``HEAD`` plus the user's current ``dvc.lock`` and ``cache: false`` outputs (metrics, plots), and
``dvc checkout`` links the cached outputs in, so DVC skips every stage already computed with the same params.
It is removed when the run ends successfully or is cancelled; a failed or crashed run's workspace (with its
checkpoints) is kept, and a retry of the same flow run (same id) continues in it and removes it when it
succeeds. ``git worktree list`` shows kept ones; ``git worktree remove --force <path>`` deletes one.

A run that syncs with the team's remotes (`detpipe.orchestration.remotes`) can instead start from an experiment commit an
earlier attempt pushed: the workspace is then a worktree of that experiment's baseline with the experiment's
files (params.yaml, dvc.lock, metrics) on top, as ``dvc exp apply`` leaves them, and ``dvc pull
--allow-missing`` fetches every output ``dvc.lock`` records (the checkpoints of a partial training included).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from detpipe.core.errors import StageError
from detpipe.orchestration.processes import dvc, git, run_logged

RUNS_DIR = ".dvc/tmp/runs"


class WorkspaceError(StageError):
    """The repository cannot host a run (no DVC repository, stages differ, no git commit); one line."""


def resolve_repo(repo: str | os.PathLike, stages: tuple[str, ...]) -> Path:
    """``repo`` as an absolute path, checked to be a git+DVC repository whose ``dvc.yaml`` defines ``stages``
    (read by DVC: `dvc.repo.index.Index.from_file`, which validates dvc.yaml and dvc.lock against DVC's schemas).

    Raises:
        WorkspaceError: not a DVC repository, no git commit to start a run from, a dvc.yaml or dvc.lock that DVC
            cannot read, or other stages.
    """
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.repo.index import Index

    root = Path(repo).expanduser().resolve()
    dvc_yaml = root / "dvc.yaml"
    if not dvc_yaml.is_file() or not (root / ".dvc").is_dir():
        raise WorkspaceError(f"{root}: not a DVC repository with a dvc.yaml")
    # before DVC reads it: DVC's Repo refuses a folder that is no git repository at all, with a less helpful line
    if git(root, "rev-parse", "--verify", "-q", "HEAD", check=False).returncode:
        raise WorkspaceError(f"{root}: a run is a DVC experiment, which needs a git commit to start from "
                             "(git init && git add -A && git commit)")
    try:
        with Repo(str(root)) as dvc_repo:
            found = [stage.name for stage in Index.from_file(dvc_repo, str(dvc_yaml)).stages]
    except DvcException as e:
        why = str(e).strip().partition("\n")[0] or type(e).__name__
        raise WorkspaceError(f"{root}: DVC cannot read the pipeline: {why}") from None
    if sorted(found) != sorted(stages):
        raise WorkspaceError(f"{dvc_yaml}: stages {found} differ from the flow's {list(stages)}")
    return root


def _outputs(root: Path) -> list[tuple[str, bool, str | None]]:
    """Every output (outs, metrics, plots) of the pipeline in ``root`` as DVC reads it (`dvc.repo.Repo`'s index:
    dvc.yaml, with the hashes dvc.lock records): ``(path relative to root, stored in DVC's cache, md5 or None)``,
    the md5 being dvc.lock's (``<md5>.dir`` for a folder; None when dvc.lock records none). Stage by stage in
    dvc.yaml's order, by path within a stage (dvc.lock's order).

    Raises:
        dvc.exceptions.DvcException: DVC cannot read dvc.yaml or dvc.lock (e.g. one cut short by a kill).
    """
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return [(os.path.relpath(out.fs_path, root), out.use_cache,
                 out.hash_info.value if out.hash_info else None)
                for stage in repo.index.stages for out in sorted(stage.outs, key=lambda o: o.def_path)]


def pipeline_outs(root: Path, cached: bool) -> list[str]:
    """Paths (relative to ``root``, sorted) of the pipeline's outputs stored in DVC's cache (``cached``) or in
    git (``cache: false`` metrics and plots).

    Raises:
        dvc.exceptions.DvcException: DVC cannot read dvc.yaml or dvc.lock.
    """
    return sorted({path for path, in_cache, _ in _outputs(root) if in_cache == cached})


def locked_outs(root: Path) -> dict[str, str]:
    """The md5 that ``root``'s dvc.lock records for each output stored in DVC's cache, by path relative to
    ``root`` (``<md5>.dir`` for a folder: the name of its listing in the cache); an output dvc.lock records no
    hash for is left out. Ordered as `_outputs`.

    Raises:
        FileNotFoundError: no dvc.lock (no stage has finished).
        dvc.exceptions.DvcException: DVC cannot read dvc.yaml or dvc.lock.
    """
    if not (root / "dvc.lock").is_file():
        raise FileNotFoundError(f"{root / 'dvc.lock'}: no such file (no stage of the pipeline has finished)")
    return {path: md5 for path, in_cache, md5 in _outputs(root) if in_cache and md5}


def locked_uncached_outs(root: Path) -> list[str]:
    """The ``cache: false`` outputs (metrics, plots) that ``root``'s dvc.lock records a hash for: those of the stages
    that have finished (paths relative to ``root``, sorted; [] without dvc.lock).

    Raises:
        dvc.exceptions.DvcException: DVC cannot read dvc.yaml or dvc.lock.
    """
    if not (root / "dvc.lock").is_file():
        return []
    return sorted({path for path, in_cache, md5 in _outputs(root) if not in_cache and md5})


def copy_paths(src: Path, dest: Path, rels: list[str]) -> None:
    """Copy each of ``rels`` (files or folders, relative paths) from ``src`` to the same place under ``dest``,
    merging into folders that exist there; a path missing under ``src`` is skipped. Raises OSError."""
    for rel in rels:
        if (src / rel).is_dir():
            shutil.copytree(src / rel, dest / rel, dirs_exist_ok=True)
        elif (src / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dest / rel)


def untracked_pipeline_files(root: Path) -> list[str]:
    """Untracked files that ``dvc exp run`` would commit with an experiment but ``dvc exp save`` needs
    ``--include-untracked`` for: ``cache: false`` outputs and the ``.gitignore`` files DVC writes beside
    cached outputs (paths relative to ``root``, sorted).

    Raises:
        dvc.exceptions.DvcException: DVC cannot read dvc.yaml or dvc.lock.
        subprocess.CalledProcessError: ``git ls-files`` failed.
    """
    outs = _outputs(root)
    paths = {path for path, in_cache, _ in outs if not in_cache}
    paths |= {os.path.join(os.path.dirname(path), ".gitignore") for path, in_cache, _ in outs if in_cache}
    out = git(root, "ls-files", "-z", "--others", "--exclude-standard", "--", *sorted(paths)).stdout
    return sorted(filter(None, out.split("\0")))


def add_worktree(repo: Path, path: Path, rev: str = "HEAD") -> None:
    """A detached git worktree of ``repo`` (a repository or one of its worktrees) at ``rev`` in ``path``, whose
    DVC cache is ``repo``'s.

    Raises:
        subprocess.CalledProcessError: git failed.
        dvc.exceptions.DvcException: DVC cannot read or write the config.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    git(repo, "worktree", "add", "--detach", str(path), rev)
    set_cache_dir(path, cache_dir(repo))


def cache_dir(root: Path) -> Path:
    """The DVC cache folder of the repository (or worktree) ``root``, absolute: what ``dvc cache dir`` prints, read
    by DVC in this process (`dvc.repo.Repo`; a ``dvc`` command costs a Python start and DVC's imports, about
    0.3 s of CPU). Raises `dvc.exceptions.DvcException` when DVC cannot read the repository's config."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return Path(repo.cache.local_cache_dir).resolve()


def set_cache_dir(root: Path, cache: Path) -> None:
    """Make ``cache`` the DVC cache of ``root`` in its local config (``.dvc/config.local``), as ``dvc config --local
    cache.dir <cache>`` does, by DVC in this process. Raises `dvc.exceptions.DvcException` (config unreadable)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo, repo.config.edit(level="local") as conf:
        conf["cache"]["dir"] = str(cache)


def _create(root: Path, ws: Path, logger, experiment: str | None, pull: bool) -> None:
    if experiment:
        add_worktree(root, ws, f"{experiment}^")
        git(ws, "restore", f"--source={experiment}", "--worktree", "--", ".")
        logger.info("workspace starts from experiment commit %s (files as `dvc exp apply` leaves them)", experiment)
        run_logged(dvc("pull" if pull else "checkout", "--allow-missing"), ws, logger)
        return
    add_worktree(root, ws)
    copy_paths(root, ws, ["dvc.lock", *pipeline_outs(root, cached=False)])
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
        subprocess.CalledProcessError: git or a DVC command could not create it.
        dvc.exceptions.DvcException: DVC could not read or write its config.
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
