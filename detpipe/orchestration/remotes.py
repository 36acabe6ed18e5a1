"""The team's remotes for a run in a throw-away workspace: the git remote ``origin`` (experiments) and the
repository's default DVC remote (data, models, checkpoints, DVC's run-cache).

A flow run that syncs (every run of a ``--source`` deployment, whose code is a temporary clone the worker
deletes afterwards; opt-in for others) keeps nothing only locally:

* `check` first: both remotes configured and reachable, else one-line `RemoteError` within seconds;
* `find_experiment`: an experiment of the run's name already on ``origin`` (an earlier attempt of this flow run,
  maybe on another worker) is fetched and the workspace starts from it (`detpipe.orchestration.workspace.isolated`);
* every stage runs as ``dvc repro --single-item <stage> --pull`` (DVC fetches missing inputs, and restores a
  stage another run already computed from the remote run-cache instead of running it), then `push_stage`
  uploads its outputs and run-cache entry;
* while training runs, `pushing_checkpoints` pushes its checkpoints every ``flows.push_checkpoints_every`` new
  ones as a partial experiment (`push_partial`), so a retry on any worker resumes from the newest pushed one;
* a failed, cancelled or interrupted run pushes what it has (`keeping`); a finished one is saved and pushed
  with ``dvc exp push`` (flows/train.py). ``dvc exp pull origin <name>`` then brings any of them into a clone.

A partial experiment is an ordinary DVC experiment commit (parent: the run's baseline commit; its ref is
`detpipe.orchestration.experiments.experiment_ref`, where a finished run's ``dvc exp save`` puts it) whose ``dvc.lock``
records the finished stages and, for an unfinished training, ``checkpoints/`` (`detpipe.orchestration.commit_partial`:
``models/model.pt`` without a hash, so DVC sees the stage as not done). It is made in a second worktree from
hard links to the finished checkpoint files, so the running training is never paused or touched. The finished
run's push (`push_experiment`) replaces it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from detpipe.core.errors import StageError
from detpipe.orchestration import experiments
from detpipe.orchestration.processes import dvc, git, run_logged

GIT_REMOTE = "origin"
SYNC_ENV = "DETPIPE_SYNC"      # "1" in a ``--source`` deployment's job environment: its runs always sync
PROBE_TIMEOUT_S = 30.0
POLL_S = 2.0                   # how often `pushing_checkpoints` looks for new checkpoint files
LINK_ATTEMPTS = 5              # listings `link_checkpoints` tries when listed files vanish before their link


class RemoteError(StageError):
    """A remote the run needs is not configured or not reachable; the message is one line naming the setting."""


class CheckpointsVanished(StageError):
    """`push_partial` of a running training found checkpoint files, but every one it listed was deleted before it
    could be linked into the snapshot, over `LINK_ATTEMPTS` listings (the training's ``keep_last`` pruning
    faster than the snapshot could take them, or its checkpoint folder emptied). Nothing is pushed: an empty
    ``checkpoints/`` would replace the run's last pushed one. The message is one line naming the folder."""


@dataclass(frozen=True)
class Remotes:
    """Where a run's results go: git remote ``git`` at ``git_url``, DVC remote ``dvc`` at ``dvc_url``."""

    git: str
    git_url: str
    dvc: str
    dvc_url: str

    def uri(self, md5: str) -> str:
        """URI of the object with this md5 in the DVC remote (DVC 3 layout ``files/md5/ab/cdef...``; a
        directory's is its ``.dir`` manifest)."""
        return f"{self.dvc_url.rstrip('/')}/files/md5/{md5[:2]}/{md5[2:]}"


@dataclass(frozen=True)
class Run:
    """A flow run that syncs: its remotes, its experiment's name and its Prefect flow run id (which partial
    experiments carry, so that only an attempt of the same flow run continues one)."""

    remotes: Remotes
    name: str
    run_id: str


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "no output")


def check(root: Path, git_remote: str = GIT_REMOTE, timeout_s: float = PROBE_TIMEOUT_S) -> Remotes:
    """The remotes of repository ``root``, each checked: configured, and answering within ``timeout_s`` s.

    Raises:
        RemoteError: no git remote ``git_remote``, or it does not answer ``git ls-remote``; no default DVC
            remote (``core.remote`` in ``.dvc/config``); the DVC remote does not answer, refuses the
            credentials, or is a local folder that does not exist (a throw-away clone's relative default
            ``../../dvc-storage`` would be deleted with it).
    """
    got = git(root, "remote", "get-url", git_remote, check=False)
    if got.returncode:
        raise RemoteError(f"{root}: no git remote '{git_remote}' to push experiments to "
                          f"(git remote add {git_remote} <url>)")
    git_url = got.stdout.strip()
    try:
        probe = git(root, "ls-remote", "--heads", git_remote, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise RemoteError(f"git remote '{git_remote}' ({git_url}) did not answer in {timeout_s:.0f} s") from None
    if probe.returncode:
        raise RemoteError(f"git remote '{git_remote}' ({git_url}) unreachable: {_first_line(probe.stderr)}")
    name, url = _probe_dvc(root, timeout_s)
    return Remotes(git=git_remote, git_url=git_url, dvc=name, dvc_url=url)


def _probe_dvc(root: Path, timeout_s: float) -> tuple[str, str]:
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        name = repo.config["core"].get("remote")
        if not name:
            raise RemoteError(f"{root / '.dvc' / 'config'}: no default DVC remote (core.remote) to pull from and "
                              "push to (dvc remote add -d <name> <url>)")
        remote = repo.cloud.get_remote(name)
        local = remote.fs.protocol == "local"
        url = remote.path if local else repo.config["remote"][name]["url"]
        result: list = []
        worker = threading.Thread(target=lambda: result.append(_exists(remote.fs, remote.path)), daemon=True)
        worker.start()
        worker.join(timeout_s)
    if not result:
        raise RemoteError(f"DVC remote '{name}' ({url}) did not answer in {timeout_s:.0f} s")
    if isinstance(result[0], Exception):
        raise RemoteError(f"DVC remote '{name}' ({url}) unreachable: {type(result[0]).__name__}: "
                          f"{_first_line(str(result[0]))}")
    if local and not result[0]:
        raise RemoteError(f"DVC remote '{name}': folder {url} does not exist; a run in a throw-away clone needs "
                          "a remote that outlives it (dvc remote add -d <name> s3://... or a shared folder)")
    return name, url


def _exists(fs, path: str) -> bool | Exception:
    try:
        if fs.protocol == "local":
            return fs.exists(path)
        fs.ls(path)                         # lists (or raises on credentials / endpoint); a new prefix is empty
        return True
    except FileNotFoundError:
        return True
    except Exception as e:  # noqa: BLE001 - reported as RemoteError by the caller
        return e


def find_experiment(root: Path, run: Run, logger) -> str | None:
    """Fetch experiment ``run.name`` from the git remote if an earlier attempt of this flow run pushed it there,
    and return its commit sha; else None (an experiment of that name from another flow run is replaced at the
    end, never continued). Raises `RemoteError` when the remote cannot be listed or fetched."""
    remote = run.remotes.git
    listing = git(root, "ls-remote", remote, "refs/exps/*", timeout=PROBE_TIMEOUT_S, check=False)
    if listing.returncode:
        raise RemoteError(f"git remote '{remote}': {_first_line(listing.stderr)}")
    refs = [ln.split("\t") for ln in listing.stdout.splitlines() if ln.endswith(f"/{run.name}")]
    if not refs:
        return None
    sha, ref = refs[0]
    fetched = git(root, "fetch", "-q", remote, f"+{ref}:{ref}", timeout=600, check=False)
    if fetched.returncode:
        raise RemoteError(f"git fetch {remote} {ref}: {_first_line(fetched.stderr)}")
    message = git(root, "log", "-1", "--format=%B", sha, check=False).stdout
    if _owner(run.run_id) not in message:
        logger.warning("experiment '%s' on %s (%s) is not from this flow run: starting anew (it is replaced "
                       "when this run pushes)", run.name, remote, ref)
        return None
    logger.info("experiment '%s' is on %s (%s, pushed by an earlier attempt of this flow run): continuing from it",
                run.name, remote, ref)
    return sha


def _owner(run_id: str) -> str:
    return f"flow run {run_id}"


def push_stage(ws: Path, stage: str, logger) -> None:
    """Upload stage ``stage``'s outputs and the run-cache (``dvc push --run-cache <stage>``).
    Raises `detpipe.orchestration.processes.CommandError`."""
    run_logged(dvc("push", "--run-cache", stage), ws, logger)


def push_experiment(ws: Path, ref: str, remotes: Remotes, logger) -> None:
    """Push the finished experiment at git ref ``ref`` of workspace ``ws``: every output ``dvc.lock`` records
    and the run-cache to the DVC remote, then the ref to the git remote (replacing a partial one).

    What ``dvc exp push --force --run-cache`` does, but with git's own push: DVC's (dulwich) cannot push from
    the shallow clone a Prefect worker makes (``git clone --depth 1``). Raises `detpipe.orchestration.processes.CommandError`."""
    run_logged(dvc("push", "--run-cache"), ws, logger)
    run_logged(["git", "push", "-q", "--force", remotes.git, f"{ref}:{ref}"], ws, logger)
    logger.info("pushed experiment %s to %s (data on DVC remote %s)", ref, remotes.git_url, remotes.dvc_url)


def _identity(cwd: Path) -> list[str]:
    """``-c user.name/-c user.email`` for a commit where git has no identity configured (a worker's clone)."""
    if git(cwd, "config", "user.email", check=False).stdout.strip() or os.environ.get("GIT_COMMITTER_EMAIL"):
        return []
    return ["-c", "user.name=detpipe", "-c", "user.email=detpipe@localhost"]


def _checkpoint_files(directory: Path) -> list[Path]:
    """``ckpt-NNNNNNN.pt`` files in ``directory`` (the names `detpipe.engine.checkpoints.checkpoint_path` gives; its
    temporary ``.ckpt-*.tmp-*`` files are not matched), oldest first; [] if there is no such folder."""
    return sorted(directory.glob("ckpt-*.pt"))


def link_checkpoints(src_dir: Path, dest_dir: Path, attempts: int = LINK_ATTEMPTS) -> list[str]:
    """Hard-link the checkpoint files of ``src_dir`` into ``dest_dir`` (created if missing; must not hold files
    of those names), newest first, listing ``src_dir`` right before linking.

    A running training deletes its older checkpoints as it writes new ones (`detpipe.engine.hooks.CheckpointHook`,
    ``keep_last``; each file appears complete, by rename): a listed file may be gone when its turn comes. Then,
    once the listing is done, ``src_dir`` is listed again and the files not yet linked are linked, up to
    ``attempts`` listings in all. A linked file is safe from pruning (the link is a second name of its data).

    Returns:
        the names linked, oldest first ([] when none could be: no checkpoint, or every one vanished first).
    Raises:
        OSError: other than a listed file having vanished (e.g. ``dest_dir`` on another file system).
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    linked: set[str] = set()
    for _ in range(max(1, attempts)):
        vanished = False
        for ckpt in reversed(_checkpoint_files(src_dir)):
            if ckpt.name in linked:
                continue
            try:
                os.link(ckpt, dest_dir / ckpt.name)
            except FileNotFoundError:           # pruned (keep_last) since it was listed
                vanished = True
                continue
            linked.add(ckpt.name)
        if not vanished:
            break
    return sorted(linked)


def push_partial(ws: Path, run: Run, logger, training: bool = True) -> str | None:
    """Push the state of workspace ``ws`` as (partial) experiment ``run.name``: its ``dvc.lock`` and params and,
    with ``training`` (the train stage has not finished), the checkpoint files written so far, committed with
    `detpipe.orchestration.commit_partial` in a second worktree ``<ws>.push`` (hard links; ``ws`` is not touched, so this is
    safe while training runs). Outputs go to the DVC remote, the commit to the git remote (forced).

    The checkpoints are listed and linked (`link_checkpoints`) once the worktree exists, not before: creating it
    takes a second or more, in which the training writes new checkpoints and deletes the older ones.

    Returns:
        the experiment's git ref, or None when there is nothing to push (no dvc.lock, or ``training`` and no
        checkpoint yet; checked before the worktree is made).
    Raises:
        CheckpointsVanished: ``training``, and every checkpoint file vanished before it could be linked (see
            `link_checkpoints`); nothing was pushed, the experiment on the remotes is left as it was.
        detpipe.orchestration.processes.CommandError: a DVC or git command failed.
    """
    ckpt_dir = ws / "checkpoints"
    if (training and not _checkpoint_files(ckpt_dir)) or not (ws / "dvc.lock").is_file():
        return None
    from detpipe.orchestration.workspace import add_worktree, copy_paths, locked_uncached_outs, remove

    baseline = experiments.baseline(ws)
    snap = ws.with_name(ws.name + ".push")
    remove(ws, snap)
    add_worktree(ws, snap, baseline)
    try:
        for rel in ("params.yaml", "dvc.lock"):
            shutil.copy2(ws / rel, snap / rel)
        # the finished stages' cache: false outputs (plots, metrics) as dvc.lock records them: without them a retry
        # starting from this snapshot would find those stages changed and run them again
        copy_paths(ws, snap, locked_uncached_outs(ws))
        with contextlib.suppress(OSError):    # curves so far (a resumed training rewrites them from its checkpoint)
            shutil.copytree(ws / "dvclive", snap / "dvclive", dirs_exist_ok=True)
        what = "finished stages"
        if training:
            linked = link_checkpoints(ckpt_dir, snap / "checkpoints")
            if not linked:
                raise CheckpointsVanished(
                    f"{ckpt_dir}: every checkpoint file was deleted before it could be linked into the snapshot "
                    f"({LINK_ATTEMPTS} listings); nothing pushed, the experiment on '{run.remotes.git}' is left "
                    "as it was")
            what = f"checkpoints up to {linked[-1]}"
            run_logged([sys.executable, "-m", "detpipe.orchestration.commit_partial", "train", "--deps-from-lock"], snap, logger)
            run_logged(dvc("push", "train"), snap, logger)
        run_logged(["git", "add", "-A"], snap, logger)
        run_logged(["git", *_identity(snap), "commit", "-q", "--allow-empty", "-m",
                    f"detpipe: partial run {run.name} ({what}; {_owner(run.run_id)})"], snap, logger)
        ref = experiments.experiment_ref(baseline, run.name)
        run_logged(["git", "push", "-q", "--force", run.remotes.git, f"HEAD:{ref}"], snap, logger)
        logger.info("pushed %s as experiment '%s' (%s on %s, data on DVC remote %s)", what, run.name, ref,
                    run.remotes.git_url, run.remotes.dvc_url)
        return ref
    finally:
        remove(ws, snap)


@contextlib.contextmanager
def pushing_checkpoints(ws: Path, run: Run, every: int, logger) -> Iterator[None]:
    """While the block runs (the train stage), `push_partial` each time ``every`` new checkpoint files have
    appeared in ``ws/checkpoints`` since the last push (``every`` 0: never). A failed push is logged as a
    warning and tried again at the next checkpoint: a remote hiccup, or checkpoints pruned faster than they
    could be linked (`CheckpointsVanished`), must not stop the training."""
    if every <= 0:
        yield
        return
    stop = threading.Event()

    def names() -> set[str]:
        return {p.name for p in (ws / "checkpoints").glob("ckpt-*.pt")}

    def loop() -> None:
        seen = names()                            # pulled or resumed-from checkpoints are pushed already
        while not stop.wait(POLL_S):
            now = names()
            if len(now - seen) >= every:
                try:
                    push_partial(ws, run, logger)
                    seen = now
                except Exception as e:  # noqa: BLE001 - see docstring
                    logger.warning("checkpoint push failed (tried again at the next checkpoint): %s", e)

    thread = threading.Thread(target=loop, name="push-checkpoints", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def keeping(ws: Path, run: Run | None, finished: dict, logger) -> Iterator[None]:
    """If the block fails or is interrupted (any exception, Prefect's cancellation included), push what
    ``run`` has as partial experiment before the exception goes on: the stages in ``finished`` and, if
    ``train`` is not among them, its checkpoints. A failing push is logged, never hides the run's error.

    With no checkpoint written yet, the finished stages alone are pushed. When the checkpoints vanished during
    the push (`CheckpointsVanished`), nothing is: a push of the finished stages alone would replace the
    checkpoints an earlier push (`pushing_checkpoints`) left on the remotes."""
    try:
        yield
    except BaseException:
        if run is not None:
            try:
                if not finished:
                    logger.info("nothing to push: no stage finished")
                elif push_partial(ws, run, logger, training="train" not in finished) is None:
                    push_partial(ws, run, logger, training=False)   # no checkpoint written yet
            except CheckpointsVanished as e:
                logger.error("could not push the run's checkpoints: %s", e)
            except Exception as e:  # noqa: BLE001 - see docstring
                logger.error("could not push the run's partial results: %s", e)
        raise
