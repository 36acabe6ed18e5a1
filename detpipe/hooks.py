"""Training loop skeleton and hooks, in the style of detectron2's ``engine/train_loop.py`` and ``hooks.py``.

The loop (`TrainerBase.train`) is short: ``before_train``; per iteration ``before_step``, ``run_step``,
``after_step``; ``after_train``. Every cross-cutting concern is a `HookBase` whose ``state_dict`` goes into
the checkpoint, so a resumed run continues exactly where the interrupted one stopped.
"""
from __future__ import annotations

import logging
import math
import os
import random
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from detpipe.errors import StageError

log = logging.getLogger("detpipe.hooks")


class HookBase:
    """A training concern with callbacks around the loop. ``self.trainer`` is set by `register_hooks`."""

    trainer: "TrainerBase"

    def before_train(self) -> None: ...
    def after_train(self) -> None: ...
    def before_step(self) -> None: ...
    def after_step(self) -> None: ...

    def state_dict(self) -> dict:
        """Plain types and tensors only (checkpoints are read with ``torch.load(weights_only=True)``)."""
        return {}

    def load_state_dict(self, state: dict) -> None: ...


class TrainerBase:
    """Iteration-based loop over hooks. ``self.iter`` is the index of the current iteration (0-based);
    after training it equals ``max_iter``. Subclasses implement `run_step` and `state_dict`."""

    def __init__(self) -> None:
        self.hooks: list[HookBase] = []
        self.iter = self.start_iter = self.max_iter = 0

    def register_hooks(self, hooks: list[HookBase]) -> None:
        for h in hooks:
            h.trainer = self
        self.hooks.extend(hooks)

    def train(self, start_iter: int, max_iter: int) -> None:
        """Run iterations ``start_iter .. max_iter - 1``; ``after_train`` runs only when all completed."""
        self.start_iter, self.max_iter = start_iter, max_iter
        self.iter = start_iter
        for h in self.hooks:
            h.before_train()
        while self.iter < max_iter:
            for h in self.hooks:
                h.before_step()
            self.run_step()
            for h in self.hooks:
                h.after_step()
            self.iter += 1
        for h in self.hooks:
            h.after_train()

    def run_step(self) -> None:
        raise NotImplementedError

    def hooks_state(self) -> dict:
        return {type(h).__name__: h.state_dict() for h in self.hooks}

    def load_hooks_state(self, state: dict) -> None:
        for h in self.hooks:
            if type(h).__name__ in state:
                h.load_state_dict(state[type(h).__name__])


def lr_factor(it: int, max_iter: int, warmup_iters: int, schedule: str = "cosine",
              milestones: tuple[float, ...] = (), gamma: float = 0.1, warmup_start: float = 0.001) -> float:
    """LR multiplier at iteration ``it`` (0-based) of ``max_iter``.

    Linear warmup from ``warmup_start`` to 1 over ``warmup_iters`` iterations (the warmup of torchvision's
    ``references/detection/engine.py``), multiplied by either a half-cosine from 1 to 0 over the remaining
    iterations (``cosine``), or ``gamma ** k`` after the k-th milestone, milestones being fractions of
    ``max_iter`` (``multistep``, as torch's ``MultiStepLR``).
    """
    warm = 1.0
    if it < warmup_iters:
        alpha = it / warmup_iters
        warm = warmup_start * (1 - alpha) + alpha
    if schedule == "multistep":
        return warm * gamma ** sum(it >= round(m * max_iter) for m in milestones)
    if it < warmup_iters:
        return warm
    span = max(1, max_iter - warmup_iters)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (it - warmup_iters) / span)))


class LRScheduleHook(HookBase):
    """Sets every param group's lr to ``base_lr * lr_factor(iter, ...)`` before each step (per iteration)."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, warmup_iters: int,
                 schedule: str = "cosine", milestones: tuple[float, ...] = (), gamma: float = 0.1):
        self.optimizer, self.base_lr, self.warmup_iters = optimizer, base_lr, warmup_iters
        self.schedule, self.milestones, self.gamma = schedule, tuple(milestones), gamma

    def before_step(self) -> None:
        lr = self.base_lr * lr_factor(self.trainer.iter, self.trainer.max_iter, self.warmup_iters,
                                      self.schedule, self.milestones, self.gamma)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.trainer.metrics["lr"] = lr

    def state_dict(self) -> dict:
        return {"base_lr": self.base_lr, "warmup_iters": self.warmup_iters, "schedule": self.schedule}


class EMAHook(HookBase):
    """Exponential moving average of the weights (and buffers), updated after every step:
    ``ema = decay * ema + (1 - decay) * w`` via ``torch.optim.swa_utils.AveragedModel`` with
    ``get_ema_multi_avg_fn(decay)``. When enabled, the EMA weights are what gets evaluated and exported."""

    def __init__(self, model: torch.nn.Module, decay: float):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.model, self.decay = model, decay

    def after_step(self) -> None:
        self.ema.update_parameters(self.model)

    def weights(self) -> dict:
        """The EMA state_dict with the keys of the plain model."""
        return self.ema.module.state_dict()

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state["ema"])


class EvalHook(HookBase):
    """Every ``period`` iterations and at the end, COCO-evaluates the model (its EMA when there is one) on
    val on rank 0 with ``eval_fn(model) -> {"AP": ..., ...}``; logs the stats as ``val/<name>`` and saves the
    weights with the best AP@[.5:.95] so far to ``best_path`` (atomically)."""

    def __init__(self, period: int, eval_fn, best_path: Path, config: dict, ema: EMAHook | None = None):
        self.period, self.eval_fn, self.best_path, self.config, self.ema = period, eval_fn, Path(best_path), config, ema
        self.best_ap, self.best_iter = -1.0, -1

    def after_step(self) -> None:
        done = self.trainer.iter + 1
        if done % self.period and done != self.trainer.max_iter:
            return
        if self.trainer.rank == 0:
            model = self.ema.ema.module if self.ema else self.trainer.module
            was_training = model.training
            model.eval()
            stats = self.eval_fn(model)
            model.train(was_training)
            self.trainer.eval_metrics = {f"val/{k}": v for k, v in stats.items()}
            if stats["AP"] > self.best_ap:
                self.best_ap, self.best_iter = float(stats["AP"]), done
                self.best_path.parent.mkdir(parents=True, exist_ok=True)
                save_atomic({"model": model.state_dict(), "config": self.config, "iters": done,
                             "AP": self.best_ap}, self.best_path)
                log.info("iteration %d: AP %.4f, best so far -> %s", done, self.best_ap, self.best_path)
        if self.trainer.distributed:
            dist.barrier()

    def state_dict(self) -> dict:
        return {"best_ap": self.best_ap, "best_iter": self.best_iter}

    def load_state_dict(self, state: dict) -> None:
        self.best_ap, self.best_iter = float(state["best_ap"]), int(state["best_iter"])


def rng_state() -> dict:
    """This process's RNG states (Python, NumPy, torch CPU, CUDA) as tensors and plain types."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of `rng_state`."""
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_CKPT_RE = re.compile(r"^ckpt-(\d{7})\.pt$")


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files ``ckpt-NNNNNNN.pt`` in ``directory``, oldest iteration first."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _CKPT_RE.match(p.name)),
                  key=lambda p: int(_CKPT_RE.match(p.name).group(1)))


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file in the same directory, fsync, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class CheckpointHook(HookBase):
    """Writes ``ckpt-NNNNNNN.pt`` (N = iterations completed) every ``period`` iterations and at the end,
    atomically, on rank 0, keeping the last ``keep_last``. All ranks' RNG states are gathered into it."""

    def __init__(self, directory: Path, period: int, keep_last: int):
        self.directory, self.period, self.keep_last = Path(directory), period, keep_last

    def after_step(self) -> None:
        done = self.trainer.iter + 1
        if done % self.period == 0 or done == self.trainer.max_iter:
            self.save(done)

    def save(self, done: int) -> None:
        state = self.trainer.checkpoint_state(done)  # collective: every rank must call it
        if self.trainer.rank != 0:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"ckpt-{done:07d}.pt"
        save_atomic(state, path)
        for old in list_checkpoints(self.directory)[:-self.keep_last]:
            old.unlink(missing_ok=True)
        log.info("saved checkpoint %s", path)


class MetricsHook(HookBase):
    """Logs the step's metrics with DVCLive on rank 0 (``dvclive/``: metrics.json, plots/metrics/*.tsv).

    Its state is the history of logged rows, so a resumed run rewrites ``dvclive/`` from the checkpoint's
    history (dropping rows logged after that checkpoint) and continues: the curves have no gap or duplicate.
    """

    def __init__(self, directory: str = "dvclive", period: int = 1):
        self.directory, self.period = directory, period
        self.history: list[dict] = []
        self.live = None

    def before_train(self) -> None:
        if self.trainer.rank != 0:
            return
        from dvclive import Live

        self.live = Live(self.directory, dvcyaml=None, save_dvc_exp=False, report=None, monitor_system=False)
        for row in self.history:
            self._log(row)

    def _log(self, row: dict) -> None:
        self.live.step = row["step"]
        for k, v in row.items():
            if k != "step":
                self.live.log_metric(k, v)
        self.live.next_step()

    def after_step(self) -> None:
        if self.trainer.rank != 0:
            return
        done = self.trainer.iter + 1
        if done % self.period and done != self.trainer.max_iter and not self.trainer.eval_metrics:
            return
        row = {"step": done, **{f"train/{k}": float(v) for k, v in self.trainer.metrics.items()},
               **{k: float(v) for k, v in self.trainer.eval_metrics.items()}}
        self.trainer.eval_metrics = {}
        self.history.append(row)
        self._log(row)

    def after_train(self) -> None:
        if self.live is not None:
            self.live.end()

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.history = list(state["history"])


class ProgressHook(HookBase):
    """A tqdm progress bar on rank 0 showing loss and images/s."""

    def before_train(self) -> None:
        self.bar = None
        if self.trainer.rank == 0:
            self.bar = tqdm(total=self.trainer.max_iter, initial=self.trainer.start_iter, desc="train",
                            unit="it", disable=None, mininterval=2.0)

    def after_step(self) -> None:
        if self.bar is not None:
            m = self.trainer.metrics
            self.bar.set_postfix(loss=f"{m.get('loss', float('nan')):.3f}",
                                 img_s=f"{m.get('images_per_s', 0):.1f}", refresh=False)
            self.bar.update(1)

    def after_train(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Timer:
    """Wall-clock seconds since construction or the last `lap` (``time.perf_counter``)."""

    def __init__(self):
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


def all_reduce_flag(flag: bool, distributed: bool, device: torch.device) -> bool:
    """True if ``flag`` is true on any rank (so every rank takes the same branch). ``device`` is where the
    process group's backend wants tensors (CPU for gloo, the local GPU for nccl)."""
    if not distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def check_bad_steps(count: int, limit: int, it: int) -> None:
    """Raise `StageError` once more than ``limit`` steps had a non-finite loss."""
    if count > limit:
        raise StageError(f"training: {count} steps with a non-finite loss (last at iteration {it}), more than "
                         f"train.max_bad_steps={limit}; lower train.lr or check the data")
