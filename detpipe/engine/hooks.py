"""The training hooks (see `detpipe.engine.train_loop.HookBase` for when each method runs and what a hook may do).

Values travel through ``trainer.storage``: `LRScheduleHook` puts ``lr``, `EvalHook` puts ``val/<stat>``,
the trainer's ``run_step`` puts the losses and timings; `MetricsHook` writes the storage's kept rows to DVCLive,
`ProgressHook` shows the latest values, `CheckpointHook` saves everything once an iteration is complete (at the
next ``before_step``, or ``after_train`` for the last). One rule of order: `EvalHook` is given the `EMAHook` and
evaluates its weights after each step, so the `EMAHook` must come before it in the list (`EvalHook.before_train`
checks it); no other hook depends on another's position. `TrainBatchPlotHook` draws the first batch the trainer
loads (``after_load``) to ``plots/train_batch.png``.
"""
from __future__ import annotations

import logging
import math
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from detpipe.engine.checkpoints import checkpoint_path, list_checkpoints, save_atomic
from detpipe.core.model_file import save_model_file
from detpipe.engine.train_loop import HookBase
from detpipe.core.progress import Progress

log = logging.getLogger("detpipe.engine.hooks")

# LambdaLR's warning when its first step() after construction follows no optimizer.step()
_STEP_ORDER_WARNING = re.escape("Detected call of `lr_scheduler.step()` before `optimizer.step()`")


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
    """Sets every param group's lr to ``base_lr * lr_factor(iter, ...)`` before each step (per iteration), with
    torch's ``LambdaLR``, and puts it into the storage as ``lr``.

    The lr is a function of the iteration, so the hook keeps no checkpoint state: `before_train` builds the
    scheduler at ``trainer.start_iter`` with this run's ``base_lr`` as every group's ``initial_lr`` (a resumed
    optimizer holds the checkpoint's, and at another world size ``train.base_batch_size`` changes ``base_lr``), and
    ``max_iter`` is read from the trainer (a resume at another world size changes it too)."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, warmup_iters: int,
                 schedule: str = "cosine", milestones: tuple[float, ...] = (), gamma: float = 0.1):
        self.optimizer, self.base_lr, self.warmup_iters = optimizer, base_lr, warmup_iters
        self.schedule, self.milestones, self.gamma = schedule, tuple(milestones), gamma
        self.scheduler: LambdaLR | None = None

    def _factor(self, it: int) -> float:
        return lr_factor(it, self.trainer.max_iter, self.warmup_iters, self.schedule, self.milestones, self.gamma)

    def before_train(self) -> None:
        for g in self.optimizer.param_groups:   # lr_mult: the group's factor (backbone lr, `make_optimizer`)
            g["initial_lr"] = self.base_lr * g.get("lr_mult", 1.0)
        # LambdaLR sets lr = initial_lr * _factor(it) = base_lr * lr_factor(it, ...), one float product: the rates
        # are bit-identical to setting that product by hand. last_epoch = start_iter - 1: its constructor steps
        # once, to start_iter.
        self.scheduler = LambdaLR(self.optimizer, self._factor, last_epoch=self.trainer.start_iter - 1)

    def before_step(self) -> None:
        t = self.trainer
        if t.iter == t.start_iter + 1:
            # LambdaLR's first step() warns when no optimizer.step() came before it: here that is a first step
            # skipped (non-finite loss, fp16's GradScaler), no misuse. Only this once: catch_warnings makes Python
            # forget which warnings it has already shown.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", _STEP_ORDER_WARNING, UserWarning)
                self.scheduler.step()
        elif t.iter > t.start_iter:  # at start_iter, the constructor has stepped
            self.scheduler.step()
        t.storage.put_scalar("lr", self.scheduler.get_last_lr()[0])


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
    val on rank 0 with ``eval_fn(model) -> {"AP": ..., ...}``; puts the stats into the storage as ``val/<name>``
    (rows with them are always kept) and saves the weights with the best AP@[.5:.95] so far to ``best_path``
    (atomically).

    Early stopping (``patience`` > 0, Keras' ``EarlyStopping`` rule): an evaluation whose AP does not exceed the best
    AP of the earlier ones by more than ``min_delta`` counts as stale, an improving one (and the first) resets the count; after
    ``patience`` stale evaluations in a row rank 0's decision is broadcast and every rank calls
    ``trainer.request_stop`` at that same iteration, which is put into the storage as ``stopped_early_at``. The
    count is checkpoint state: a resumed run goes on counting, and one resumed after the stop stops at once.

    Search pruning (``report``, a `detpipe.study.TrialReporter`): after each evaluation rank 0 calls
    ``report(stats, iteration)``; a returned reason stops every rank at that iteration through the same broadcast as
    early stopping, and ``search/pruned_at`` (the iteration) is put into the storage beside ``stopped_early_at``, with
    ``search/state`` ``"pruned"``; a trial that trains to its end (or stops early by patience) gets ``search/state``
    ``"complete"`` at its last evaluation, so `dvc exp show` lists every trial's state as text.

    The one order rule among the hooks: ``ema`` must be registered before this hook, so that its ``after_step``
    has averaged in the iteration this hook evaluates (`detpipe.engine.trainer.build_trainer` registers LR, EMA,
    eval, metrics, checkpoints, progress). `before_train` raises ValueError when ``ema`` is not among the trainer's
    hooks before this one."""

    def __init__(self, period: int, eval_fn, best_path: Path, config: dict, ema: EMAHook | None = None,
                 patience: int = 0, min_delta: float = 0.0, report=None):
        self.period, self.eval_fn, self.best_path, self.config, self.ema = period, eval_fn, Path(best_path), config, ema
        self.patience, self.min_delta, self.report = patience, min_delta, report
        self.best_ap, self.best_iter, self.stale = -1.0, -1, 0

    def _reason(self) -> str | None:
        if not self.patience or self.stale < self.patience:
            return None
        return (f"val AP did not improve by more than {self.min_delta} for {self.stale} evaluations (train.patience "
                f"{self.patience}; best AP {self.best_ap:.4f} at iteration {self.best_iter})")

    def before_train(self) -> None:
        hooks = [id(h) for h in self.trainer.hooks]
        if self.ema is not None and id(self.ema) not in hooks[:hooks.index(id(self))]:
            raise ValueError("EvalHook evaluates the EMA of the iteration just done: its EMAHook must be registered "
                             "before it")
        reason = self._reason()  # a run resumed after its early stop: nothing more to train
        if reason:
            self.trainer.request_stop(reason)

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
            self.trainer.storage.put_scalars(keep=True, **{f"val/{k}": v for k, v in stats.items()})
            improved = self.best_iter < 0 or stats["AP"] > self.best_ap + self.min_delta  # the first one: a reference
            self.stale = 0 if improved else self.stale + 1
            if stats["AP"] > self.best_ap:
                self.best_ap, self.best_iter = float(stats["AP"]), done
                save_model_file(self.best_path, model.state_dict(), self.config, done, AP=self.best_ap)
                log.info("iteration %d: AP %.4f, best so far -> %s", done, self.best_ap, self.best_path)
            pruned = self.report(stats, done) if self.report is not None else None
            if pruned:
                self.trainer.storage.put_scalars(keep=True, **{"search/pruned_at": done, "search/state": "pruned"})
            elif self.report is not None and (done == self.trainer.max_iter or self._reason()):
                self.trainer.storage.put_scalars(keep=True, **{"search/state": "complete"})
        box = [(self._reason() or pruned) if self.trainer.rank == 0 else None]
        if self.trainer.distributed:  # every rank waits for rank 0's evaluation and takes its decision
            dist.broadcast_object_list(box, src=0)
        if box[0] and done < self.trainer.max_iter:
            self.trainer.storage.put_scalars(keep=True, stopped_early_at=done)
            self.trainer.request_stop(box[0])

    def state_dict(self) -> dict:
        return {"best_ap": self.best_ap, "best_iter": self.best_iter, "stale": self.stale}

    def load_state_dict(self, state: dict) -> None:
        self.best_ap, self.best_iter = float(state["best_ap"]), int(state["best_iter"])
        self.stale = int(state.get("stale", 0))


class CheckpointHook(HookBase):
    """Writes ``ckpt-NNNNNNN.pt`` (N = iterations completed) every ``period`` iterations and at the end,
    atomically, on rank 0, keeping the last ``keep_last``. All ranks' RNG states are gathered into it.

    A checkpoint after N iterations is written at ``before_step`` of iteration N (or ``after_train`` once all
    ``max_iter`` completed): every hook has then finished iteration N - 1, whatever the hooks' order."""

    def __init__(self, directory: Path, period: int, keep_last: int):
        self.directory, self.period, self.keep_last = Path(directory), period, keep_last

    def before_step(self) -> None:
        it = self.trainer.iter
        if it > self.trainer.start_iter and it % self.period == 0:
            self.save(it)

    def after_train(self) -> None:
        t = self.trainer
        done = t.iter == t.max_iter or t.stop_reason is not None  # completed or stopped early (no error, interrupt)
        if done and t.iter > t.start_iter:
            self.save(t.iter)

    def save(self, done: int) -> None:
        state = self.trainer.checkpoint_state(done)  # collective: every rank must call it
        if self.trainer.rank != 0:
            return
        path = checkpoint_path(self.directory, done)
        save_atomic(state, path)
        for old in list_checkpoints(self.directory)[:-self.keep_last]:
            old.unlink(missing_ok=True)
        log.info("saved checkpoint %s", path)


class MetricsHook(HookBase):
    """Writes the storage's kept rows with DVCLive on rank 0 (``dvclive/``: metrics.json,
    plots/metrics/*.tsv); names without a ``/`` get a ``train/`` prefix.

    The rows live in the storage, which is in the checkpoint: a resumed run rewrites ``dvclive/`` from the
    checkpoint's rows (dropping rows logged after that checkpoint) and continues, so the curves have no gap or
    duplicate. Rows are written once complete (next ``before_step``, and ``after_train``)."""

    def __init__(self, directory: str = "dvclive"):
        self.directory = directory
        self.live = None
        self.written = 0

    def before_train(self) -> None:
        if self.trainer.rank != 0:
            return
        from dvclive import Live

        self.live = Live(self.directory, dvcyaml=None, save_dvc_exp=False, report=None, monitor_system=False)
        self.written = 0
        self._write()

    def _write(self) -> None:
        if self.live is None:
            return
        for row in self.trainer.storage.history[self.written:]:
            self.live.step = row["step"]
            for k, v in row.items():
                if k != "step":
                    self.live.log_metric(k if "/" in k else f"train/{k}", v)
            self.live.next_step()
        self.written = len(self.trainer.storage.history)

    def before_step(self) -> None:
        self._write()

    def after_train(self) -> None:
        if self.live is not None:
            self._write()
            self.live.end()
            self.live = None


class ProgressHook(HookBase):
    """Progress on rank 0 (`detpipe.core.progress.Progress`): a tqdm bar on a TTY, else a log line every ``every_s``
    seconds with iteration/total, epoch, loss, lr, images/s and ETA. Reads the trainer's ``iters_per_epoch`` and
    ``images_per_iter``."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.progress: Progress | None = None

    def before_train(self) -> None:
        t = self.trainer
        self.progress = Progress(t.max_iter, "train", self.every_s, initial=t.start_iter, enabled=t.rank == 0)

    def after_step(self) -> None:
        t, s = self.trainer, self.trainer.storage
        epochs = -(-t.max_iter // t.iters_per_epoch)
        self.progress.update(1, t.images_per_iter, epoch=f"{t.iter // t.iters_per_epoch + 1}/{epochs}",
                             loss=s.value("loss"), lr=s.value("lr"))

    def after_train(self) -> None:
        if self.progress is not None:
            self.progress.close()


class TrainBatchPlotHook(HookBase):
    """Draws what the model is fed: rank 0's first batch of a fresh run (iteration 0, epoch 0), exactly as the
    loader yielded it to ``run_step`` (``after_load``: after augmentation, before the forward pass), with its
    boxes (and masks) over the images, tiled into one PNG at ``path`` (`detpipe.vis.batch_plot.draw_batch`),
    written atomically before the first step runs.

    The PNG's bytes are the hook's checkpoint state, so a resumed run, which never sees iteration 0, writes the
    same file again when it is missing or differs (``dvc repro`` removes the stage's outputs before it runs) and
    draws nothing; drawing reads the batch and changes neither it nor any RNG, so training is the same with or
    without this hook."""

    def __init__(self, path: Path, label_names: list[str] | None = None, max_images: int = 16,
                 max_side: int = 640):
        self.path, self.label_names = Path(path), label_names
        self.max_images, self.max_side = max_images, max_side
        self.png: bytes | None = None

    def before_train(self) -> None:
        if self.trainer.rank == 0 and self.png is not None and \
                (not self.path.is_file() or self.path.read_bytes() != self.png):
            self._write("from the checkpoint: drawn at iteration 0 of this training")

    def after_load(self, batch: list) -> None:
        if self.trainer.rank != 0 or self.trainer.iter != 0 or self.png is not None:
            return
        from detpipe.vis.batch_plot import draw_batch
        from detpipe.vis.drawing import encode_png

        self.png = encode_png(draw_batch(batch, self.label_names, self.max_images, self.max_side))
        self._write("the first training batch as the model is fed")

    def _write(self, what: str) -> None:
        from detpipe.core.files import atomic_write_bytes

        atomic_write_bytes(self.path, self.png)
        log.info("wrote %s (%s)", self.path, what)

    def state_dict(self) -> dict:
        return {} if self.png is None else {"png": torch.frombuffer(bytearray(self.png), dtype=torch.uint8)}

    def load_state_dict(self, state: dict) -> None:
        if "png" in state:
            self.png = state["png"].numpy().tobytes()
