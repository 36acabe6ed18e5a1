"""What a search trial costs beyond its training (docs/search.md): the wall time of one trial of ``python -m
flows.search`` (from Optuna's ask to its tell: Prefect flow run, git worktree, DVC, training, evaluate, export,
``dvc exp save``) ÷ the same training run alone (``python -m stages.train`` in a copy of the same repository:
process start, torchrun, the training). Also a pruned trial's wall time ÷ a full one's.

On the learns data (`tests/support/search.py`: 4 COCO128 images, val = the same images), one thread, two enqueued
trials: lr 0.05 (full) and lr 1e-5 (pruned by the median pruner at its first evaluation). Needs a Prefect API
(``$PREFECT_API_URL``; without one Prefect starts a temporary server, whose start is not in the trial times).
Usage: ``python -m benchmarks.search_overhead [--iterations 24 --eval-every 6]``. Last line ``ratio: X`` (trial ÷
training alone).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--eval-every", type=int, default=6)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import optuna

    from detpipe.study import open_storage
    from support.search import learns_repo

    tmp = Path(tempfile.mkdtemp(prefix="detpipe-bench-search-"))
    try:
        train = {"epochs": args.iterations, "eval_every": args.eval_every, "checkpoint_every": args.eval_every}
        repo = learns_repo(tmp / "repo", train=train, search={
            "study": "bench", "n_trials": 2, "startup_trials": 1, "space": {"train.lr": "choice 0.05 0.00001"}})
        alone = tmp / "alone"
        shutil.copytree(repo, alone, symlinks=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "stages.train"], cwd=alone, check=True, capture_output=True)
        t_train = time.perf_counter() - t0

        storage = open_storage(str(repo / "search" / "bench.journal"))
        study = optuna.create_study(study_name="bench", storage=storage, direction="maximize")
        study.enqueue_trial({"train.lr": 0.05})
        study.enqueue_trial({"train.lr": 0.00001})
        proc = subprocess.run([sys.executable, "-m", "flows.search", "--repo", str(repo)], cwd=repo,
                              capture_output=True, text=True)
        if proc.returncode:
            print(proc.stdout[-4000:], proc.stderr[-4000:])
            return 1
        full, pruned = optuna.load_study(study_name="bench", storage=storage).trials
        wall = [(t.datetime_complete - t.datetime_start).total_seconds() for t in (full, pruned)]
        print(f"training alone (python -m stages.train, {args.iterations} iterations, eval every "
              f"{args.eval_every}): {t_train:.1f} s")
        print(f"full trial ({full.state.name}, lr 0.05, AP50 {full.value:.3f}): {wall[0]:.1f} s; overhead "
              f"{wall[0] - t_train:.1f} s = {(wall[0] - t_train) / t_train:.2f} of the training")
        print(f"pruned trial ({pruned.state.name} at iteration {pruned.user_attrs.get('pruned_at')}): "
              f"{wall[1]:.1f} s = {wall[1] / wall[0]:.2f} of the full trial")
        print(f"ratio: {wall[0] / t_train:.2f}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
