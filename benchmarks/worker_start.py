"""Seconds of one short train stage run (``python -m stages.train``: launcher, torchrun's agent, the workers, a few
iterations): workers forked from the agent ÷ workers started as new interpreters (``exec``, plain torchrun), same
workdir and params, same run (`detpipe.launch.worker_start.WORKER_START_ENV`). Goal < 1: the suite launches the train
stage about 165 times, mostly for a few iterations, so the workers' start-up is most of each launch.

Each round runs both ways (alternating which goes first), from scratch (``checkpoints/`` and ``models/`` removed);
the figure is the ratio of the medians of wall time, and ``models/model.pt`` must be byte-identical both ways
(the same training). CPU seconds (the stage and its children: ``resource.RUSAGE_CHILDREN``) are printed too.

    python -m benchmarks.worker_start [--images 12] [--nproc 1] [--epochs 1] [--rounds 3]

Last line: ``ratio: <fork median s / exec median s>``.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

from benchmarks._workdir import env, temporary_workdir


def run_once(work, start: str) -> tuple[float, float, str]:
    """One train stage run in ``work`` with workers started by ``start``: (wall s, CPU s, md5 of model.pt)."""
    for out in ("checkpoints", "models", "dvclive"):
        shutil.rmtree(work / out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "stages.train"], cwd=work,
                          env={**env(), "DETPIPE_WORKER_START": start},
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"train ({start}) failed:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, hashlib.md5((work / "models" / "model.pt").read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=1, help="workers (train.nproc_per_node)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    overrides = {"epochs": a.epochs, "batch_size": 4, "nproc_per_node": a.nproc, "threads": 1, "warmup_iters": 1}
    with temporary_workdir(a.images, overrides) as work:
        walls, cpus, digests = {"fork": [], "exec": []}, {"fork": [], "exec": []}, set()
        for r in range(a.rounds):
            for start in (("fork", "exec") if r % 2 == 0 else ("exec", "fork")):
                wall, cpu, digest = run_once(work, start)
                walls[start].append(wall)
                cpus[start].append(cpu)
                digests.add(digest)
                print(f"round {r} {start}: {wall:.2f} s wall, {cpu:.2f} s CPU, model.pt md5 {digest}", flush=True)
        if len(digests) != 1:
            sys.exit(f"model.pt differs between the runs: {sorted(digests)}")
        for start in walls:
            print(f"{start}: median {statistics.median(walls[start]):.2f} s wall, "
                  f"{statistics.median(cpus[start]):.2f} s CPU ({a.nproc} worker(s), {os.cpu_count()} cores)")
        print(f"ratio: {statistics.median(walls['fork']) / statistics.median(walls['exec']):.3f}")


if __name__ == "__main__":
    main()
