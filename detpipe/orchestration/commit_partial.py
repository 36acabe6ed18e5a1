"""Record what an interrupted stage has written so far (e.g. train's ``checkpoints/``) in ``dvc.lock`` and the
DVC cache, so that ``dvc push`` shares it and another clone can ``dvc pull`` it and resume.

Usage, from the repository root, after a training was stopped (killed, preempted, out of time)::

    python -m detpipe.orchestration.commit_partial train     # checkpoints/ (and dvclive/) into dvc.lock + .dvc/cache
    git add dvc.lock && git commit -m "train: partial run" && git push
    dvc push                                  # uploads the checkpoints

and on the other machine: ``git pull && dvc pull && dvc repro`` (train logs "resuming from ...").

Why a script: DVC 3 has no command for this. ``dvc commit train`` / ``dvc exp save`` refuse while any output of
the stage is missing ("output 'models/model.pt' does not exist"), and ``dvc add checkpoints`` refuses an output of
a pipeline stage ("overlaps with an output of stage"). DVC's Python API has the pieces (``Stage.save_outs`` with
``allow_missing``), which this script uses with two differences from ``Repo.commit(allow_missing=True)``:

* an output that does not exist is recorded in ``dvc.lock`` *without* a hash. ``Repo.commit`` keeps the hash of an
  earlier, finished run there, so a clone would ``dvc pull`` that old ``models/model.pt`` and ``dvc repro`` would
  call the unfinished stage up to date;
* nothing goes into DVC's run-cache (a partial run must never be restored as a result).

The stage's dependencies must exist (their hashes are recorded, as for a finished run); with ``--deps-from-lock``
a dependency that is another stage's output and not in the workspace gets the hash ``dvc.lock`` records for that
output (`detpipe.orchestration.remotes` snapshots a running training's checkpoints in a second worktree this way, without
copying the training data).
"""
from __future__ import annotations

import argparse
import os
import sys


def commit_partial(stage_name: str, root: str | None = None,
                   deps_from_lock: bool = False) -> tuple[list[str], list[str]]:
    """Hash and cache the existing outputs of pipeline stage ``stage_name`` and write its ``dvc.lock`` entry.

    Args:
        stage_name: a stage of ``dvc.yaml`` (e.g. ``"train"``).
        root: repository root (default: found from the current directory).
        deps_from_lock: a missing dependency that is another stage's output takes that output's hash from
            ``dvc.lock`` instead of failing.
    Returns:
        ``(recorded, missing)``: output paths (as written in ``dvc.yaml``) recorded with their hash, and those
        that do not exist (recorded without a hash, so ``dvc status`` shows the stage as changed).
    Raises:
        dvc.exceptions.DvcException (and subclasses): unknown stage, a missing dependency, repository locked
        by a running DVC command.
    """
    from dvc.repo import Repo
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.meta import Meta

    with Repo(root) as repo, repo.lock, repo.scm_context(quiet=True):
        stage = repo.stage.get_target(stage_name)
        _save_deps(repo, stage, deps_from_lock)     # raises if a dependency is missing
        stage.save_outs(allow_missing=True)
        recorded, missing = [], []
        for out in stage.outs:
            if out.exists:
                recorded.append(out.def_path)
            else:                                   # drop a previous run's hash (see module docstring)
                out.hash_info, out.meta, out.obj = HashInfo(), Meta(), None
                missing.append(out.def_path)
        stage.md5 = stage.compute_md5()
        stage.commit(allow_missing=True)            # existing, cached outputs -> .dvc/cache
        stage.dump(update_pipeline=False)           # dvc.lock only
    return recorded, missing


def _save_deps(repo, stage, deps_from_lock: bool) -> None:
    from dvc.exceptions import DvcException

    if not deps_from_lock:
        stage.save_deps()
        return
    recorded = [o for o in repo.index.outs if o.hash_info]
    for dep in stage.deps:
        if dep.exists:
            dep.save()
            continue
        path = os.path.abspath(dep.fs_path)
        for out in recorded:
            top = os.path.abspath(out.fs_path)
            if path == top:
                dep.hash_info, dep.meta = out.hash_info, out.meta
                break
            if path.startswith(top + os.sep) and out.hash_info.isdir:   # a file inside a directory output
                found = out.get_obj().get(tuple(os.path.relpath(path, top).split(os.sep)))
                if found:
                    dep.meta, dep.hash_info = found
                    break
        else:
            raise DvcException(f"dependency '{dep.def_path}' does not exist and dvc.lock records no hash for it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", help="stage name in dvc.yaml, e.g. train")
    parser.add_argument("--deps-from-lock", action="store_true",
                        help="a missing dependency that is another stage's output takes its dvc.lock hash")
    args = parser.parse_args(argv)
    from dvc.exceptions import DvcException

    try:
        recorded, missing = commit_partial(args.stage, deps_from_lock=args.deps_from_lock)
    except DvcException as e:
        print(f"error: {args.stage}: {e}", file=sys.stderr)
        return 2
    print(f"{args.stage}: recorded {', '.join(recorded) or 'nothing'}"
          + (f"; not yet written (no hash): {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
