"""Record what an interrupted stage has written so far (e.g. train's ``checkpoints/``) in ``dvc.lock`` and the
DVC cache, so that ``dvc push`` shares it and another clone can ``dvc pull`` it and resume.

Usage, from the repository root, after a training was stopped (killed, preempted, out of time)::

    python -m detpipe.commit_partial train     # checkpoints/ (and dvclive/) into dvc.lock + .dvc/cache
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

The stage's dependencies must all exist (their hashes are recorded, as for a finished run).
"""
from __future__ import annotations

import argparse
import sys


def commit_partial(stage_name: str, root: str | None = None) -> tuple[list[str], list[str]]:
    """Hash and cache the existing outputs of pipeline stage ``stage_name`` and write its ``dvc.lock`` entry.

    Args:
        stage_name: a stage of ``dvc.yaml`` (e.g. ``"train"``).
        root: repository root (default: found from the current directory).
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
        stage.save_deps()                           # raises if a dependency is missing
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", help="stage name in dvc.yaml, e.g. train")
    args = parser.parse_args(argv)
    from dvc.exceptions import DvcException

    try:
        recorded, missing = commit_partial(args.stage)
    except DvcException as e:
        print(f"error: {args.stage}: {e}", file=sys.stderr)
        return 2
    print(f"{args.stage}: recorded {', '.join(recorded) or 'nothing'}"
          + (f"; not yet written (no hash): {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
