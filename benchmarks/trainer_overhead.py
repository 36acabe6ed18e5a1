"""Seconds per step of our trainer (all default hooks on) ÷ a bare PyTorch loop: same model, batch, cached data,
same process, same run. Goal ≤ 1.03.

Both loops run ``--iters`` timed steps after ``--warmup`` untimed ones, alternating ``--rounds`` times; the
figure is the ratio of the median per-step times. Usage: ``python -m benchmarks.trainer_overhead``.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from benchmarks._workdir import cached_workdir
from detpipe import params as params_mod
from detpipe.data.dataset import collate
from detpipe.data.sampler import ResumableDistributedSampler
from detpipe.engine.train_loop import HookBase


class _StepClock(HookBase):
    """Wall time of every full iteration: from one ``before_step`` to the next (and to ``after_train`` for the
    last), which covers every other hook, ``run_step`` and the storage, whatever the hooks' order."""

    def __init__(self):
        self.times, self.t0 = [], None

    def before_step(self):
        now = time.perf_counter()
        if self.t0 is not None:
            self.times.append(now - self.t0)
        self.t0 = now

    def after_train(self):
        self.before_step()


def ours(cfg: params_mod.Train, work: Path, iters: int, warmup: int) -> float:
    from detpipe.engine.trainer import build_trainer

    for d in ("checkpoints", "dvclive"):
        shutil.rmtree(work / d, ignore_errors=True)
    clock = _StepClock()
    trainer = build_trainer(cfg, work / "data/cache", work / "data/arrow/meta.json", work / "checkpoints",
                            str(work / "dvclive"), extra_hooks=(clock,))
    trainer.train(0, warmup + iters)
    return statistics.median(clock.times[warmup:])


def bare(cfg: params_mod.Train, work: Path, iters: int, warmup: int) -> float:
    from detpipe.data.dataset import CachedDetectionDataset
    from detpipe.data.meta import read_meta
    from detpipe.models import build_from_config, model_config

    torch.manual_seed(cfg.seed)
    meta = read_meta(work / "data/arrow/meta.json")
    model = build_from_config(model_config(cfg.model, meta["num_classes"])).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    ds = CachedDetectionDataset(work / "data/cache", "train", hflip=cfg.hflip, seed=cfg.seed)
    sampler = ResumableDistributedSampler(len(ds), seed=cfg.seed)
    times, it = [], 0
    while it < warmup + iters:
        t0 = time.perf_counter()  # a full iteration, loading the batch included, as our trainer's clock counts it
        for images, targets in DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate,
                                          drop_last=True):
            targets = [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets]
            loss = sum(model(images, targets).values())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            it += 1
            if it == warmup + iters:
                break
    return statistics.median(times[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    work = cached_workdir(128)
    try:
        cfg = params_mod.load("train", work / "params.yaml").model_copy(
            update={"batch_size": args.batch_size, "checkpoint_every": 20, "num_workers": 0,
                    "augment": "flip"})  # the bare loop flips only: the trainer must feed the same samples
        o, b = [], []
        for _ in range(args.rounds):
            b.append(bare(cfg, work, args.iters, args.warmup))
            o.append(ours(cfg, work, args.iters, args.warmup))
            print(f"round: bare {b[-1]:.4f} s/step, ours {o[-1]:.4f} s/step", flush=True)
        sb, so = statistics.median(b), statistics.median(o)
        print(f"bare loop: {sb:.4f} s/step; our trainer (LR schedule, checkpoint every {cfg.checkpoint_every}, "
              f"DVCLive, progress): {so:.4f} s/step; batch {cfg.batch_size}, {cfg.model}")
        print(f"ratio: {so / sb:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
