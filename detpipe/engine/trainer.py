"""The detection trainer: a torchvision detector trained with DDP from the augmentation cache, resumable at any
point (the train stage's work; `stages.train` launches it).

`build_trainer` sets up the process (distributed group: `detpipe.core.distributed`; threads, seeds), builds the
model (`detpipe.models.build_detector`), optimizer, data and hooks; `train` resumes from a matching checkpoint, runs
the loop and writes ``models/model.pt``. A checkpoint holds model, optimizer, grad scaler, the event storage (metric
rows), every hook's state, the iteration (hence the sampler's position in its epoch: `detpipe.engine.elastic`) and
every rank's RNG states, plus a `fingerprint` of the params and data that produced it.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from detpipe import params as params_mod
from detpipe.engine.checkpoints import (FORMAT, find_resume_state, fingerprint, list_checkpoints,
                                       remove_partial_saves, rng_state, save_atomic, schedule_changes,
                                       schedule_params, set_rng_state)
from detpipe.data.dataset import CachedDetectionDataset
from detpipe.data.loader import micro_batches
from detpipe.data.sampler import ResumableDistributedSampler
from detpipe.data.train_transforms import TrainTransforms, resize_batch, resolve as resolve_augment, step_size
from detpipe.data.meta import read_meta, read_meta_bytes
from detpipe.core.distributed import setup_distributed
from detpipe.engine.elastic import EpochPlan, record_samples
from detpipe.engine.train_loop import HookBase, TrainerBase
from detpipe.core.errors import Interrupted, StageError, received_signal
from detpipe.engine.hooks import (CheckpointHook, EMAHook, EvalHook, LRScheduleHook, MetricsHook, ProgressHook,
                                  TrainBatchPlotHook)
from detpipe.models import build_detector, load_weights, uses_masks
from detpipe.core.model_file import load_model_file, save_model_file

EvalFnFactory = Callable[[str, Path], Callable[[torch.nn.Module], dict]]
"""``(cache_root, arrow_meta) -> eval_fn``; ``eval_fn(model) -> {"AP": ..., ...}`` (`build_trainer`)."""
from detpipe.study import TrialReporter
from detpipe.warm_start import is_warm_start, materialise_weights, warm_start_path
from detpipe.core.paths import ARROW_META, CACHE_DIR, CKPT_DIR, LIVE_DIR, MODEL as MODEL_OUT, TRAIN_BATCH_PLOT

log = logging.getLogger("detpipe.engine.trainer")


class Trainer(TrainerBase):
    """Plain SGD detection trainer over `CachedDetectionDataset` (see `detpipe.engine.train_loop.TrainerBase` for the loop).

    Everything is given to the constructor (`build_trainer` builds it): ``model`` (on ``device``, wrapped in DDP
    here when ``world_size > 1`` and compiled when ``cfg.compile``), ``optimizer``, ``dataset``, ``config``
    (`detpipe.models.model_config`'s dict), the data's `fingerprint`, and ``hooks`` (registered in this order).
    ``max_iter`` is ``cfg.epochs`` times the iterations per epoch; ``ema`` the `EMAHook` among ``hooks`` or None.
    ``run_step`` puts ``loss``, each loss term, ``data_time``, ``step_time`` (seconds), ``images_per_s``,
    ``bad_steps`` and ``memory_mb`` into ``storage``.
    Raises:
        StageError: fewer images than one step per rank.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: CachedDetectionDataset,
                 cfg: params_mod.Train, device: torch.device, rank: int, world_size: int, *, config: dict,
                 fingerprint: str, hooks: list[HookBase]):
        super().__init__(keep_every=cfg.log_every)
        self.cfg, self.device, self.rank, self.world_size = cfg, device, rank, world_size
        self.distributed = world_size > 1
        self.module, self.config, self.fingerprint = model, config, fingerprint
        # gradient_as_bucket_view: gradients live in the all-reduce buckets (no copy in and out per step)
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      gradient_as_bucket_view=True) if self.distributed else model
        self.model = torch.compile(ddp) if cfg.compile else ddp
        self.optimizer = optimizer
        self.dataset = dataset
        self.sampler = ResumableDistributedSampler(len(dataset), world_size, rank, seed=cfg.seed,
                                                   shards=dataset.sample_shards())
        self.iters_per_epoch = self.sampler.num_samples // (cfg.batch_size * cfg.accumulate)
        if self.iters_per_epoch == 0:
            raise StageError(f"{CACHE_DIR}/train: {len(dataset)} images is fewer than one step per rank "
                             f"(train.batch_size={cfg.batch_size} x accumulate {cfg.accumulate} x world size "
                             f"{world_size})")
        self.max_iter = cfg.epochs * self.iters_per_epoch
        self.plan = EpochPlan(self.iters_per_epoch, cfg.batch_size * cfg.accumulate)  # elastic: see load_checkpoint_state
        self.images_per_iter = cfg.batch_size * cfg.accumulate * world_size
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16" and device.type == "cuda")
        self.bad_steps = 0
        self._data = None
        self.ema = next((h for h in hooks if isinstance(h, EMAHook)), None)
        self.recipe = resolve_augment(cfg)  # multi-scale sizes per step (the per-sample ops are dataset.transforms)
        if cfg.augment_device == "cuda" and device.type != "cuda":
            raise StageError(f"params.yaml: train.augment_device cuda needs training on CUDA (this process trains "
                             f"on {device.type}): set train.augment_device: auto or cpu")
        self.augment_device = device if cfg.augment_device != "cpu" and device.type == "cuda" else None
        self.register_hooks(hooks)

    def _forward(self, images, targets) -> tuple[torch.Tensor, dict]:
        # channels_last applies to the model's weights (set in build_trainer): the model's transform batches these
        # 3-D images into one 4-D tensor, and its convolutions then run channels-last.
        images = [im.to(self.device, non_blocking=True) for im in images]
        targets = [{k: t[k].to(self.device) for k in ("boxes", "labels", "masks") if k in t} for t in targets]
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            loss_dict = self.model(images, targets)
        return sum(loss_dict.values()), loss_dict

    def _multi_scale(self, micro: list) -> list:
        """``train.multi_scale``: the step's images (every micro-batch) resized to the step's drawn size, a function
        of (seed, epoch, iteration) (`detpipe.data.train_transforms.step_size`; on the images' device)."""
        if not self.recipe.multi_scale or not micro or not micro[0][0]:
            return micro
        base = int(max(micro[0][0][0].shape[-2:]))
        size = step_size(self.recipe, self.cfg.seed, self.plan.locate(self.iter)[0], self.iter, base)
        return micro if size is None else [resize_batch(images, targets, size) for images, targets in micro]

    def run_step(self) -> None:
        """One optimizer step over ``train.accumulate`` micro-batches (DDP syncs gradients on the last one).
        A non-finite loss on any rank skips the step on every rank and is counted."""
        t0 = time.perf_counter()
        if self._data is None:
            self._data = micro_batches(self.dataset, self.sampler, self.plan.locate(self.iter),
                                       self.cfg.batch_size, self.cfg.accumulate, self.cfg.num_workers,
                                       pin_memory=self.device.type == "cuda", local_dir=self.cfg.cache_local_dir,
                                       local_bytes=self.cfg.cache_local_bytes, decode_device=self.device,
                                       augment_device=self.augment_device)
        # Loading leaves torch's global RNG as it was: the DataLoader draws its base seed from it when its iterator
        # starts (at the first batch of a fresh run, but after the RNG states were restored in a resumed one), and
        # the transforms seed their own. The global RNG is then the model's alone (RT-DETR's and D-FINE's
        # denoising queries), which a resumed run continues exactly from the checkpoint's state.
        with torch.random.fork_rng(devices=[]):
            micro = next(self._data)
        micro = self._multi_scale(micro)
        record_samples(self.iter, self.plan.locate(self.iter)[0], self.rank, self.world_size, micro)
        data_time = time.perf_counter() - t0
        self.loaded(micro)
        self.optimizer.zero_grad(set_to_none=True)
        total, terms, bad = 0.0, {}, False
        for k, (images, targets) in enumerate(micro):
            last = k == len(micro) - 1
            sync = contextlib.nullcontext() if last or not self.distributed else self.model.no_sync()
            with sync:
                loss, loss_dict = self._forward(images, targets)
                bad = bad or not bool(torch.isfinite(loss))
                if not bad:
                    self.scaler.scale(loss / len(micro)).backward()
            total += float(loss.detach()) / len(micro)
            for name, v in loss_dict.items():
                terms[name] = terms.get(name, 0.0) + float(v.detach()) / len(micro)
        if all_reduce_flag(bad, self.distributed, self.device):
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_steps += 1
            log.warning("iteration %d: non-finite loss %s, step skipped (%d so far)", self.iter, terms,
                        self.bad_steps)
            check_bad_steps(self.bad_steps, self.cfg.max_bad_steps, self.iter)
            self.storage.put_scalar("bad_steps", self.bad_steps)
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()
        step_time = time.perf_counter() - t0
        augmented = {}
        if self.dataset.transforms is not None:  # boxes this rank's augmentation removed in this step (crops)
            augmented["boxes_dropped"] = float(sum(int(t["dropped"]) for _, targets in micro for t in targets))
        self.storage.put_scalars(loss=total, **terms, data_time=data_time, step_time=step_time,
                                 images_per_s=self.images_per_iter / step_time, bad_steps=self.bad_steps,
                                 memory_mb=memory_mb(self.device), **augmented)

    def checkpoint_state(self, done: int) -> dict:
        """Everything needed to continue after ``done`` completed iterations (collective across ranks)."""
        rngs = [rng_state()]
        if self.distributed:
            rngs = [None] * self.world_size
            dist.all_gather_object(rngs, rng_state())
        at_next = copy.copy(self.sampler)  # the live sampler is being iterated: leave it alone
        at_next.set_epoch(*self.plan.locate(done))
        sampler_state = at_next.state_dict(consumed=0)  # where the next iteration starts reading
        return {"format": FORMAT, "iter": done, "fingerprint": self.fingerprint, "schedule": schedule_params(self.cfg),
                "world_size": self.world_size, "sampler": sampler_state,
                "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "storage": self.storage.state_dict(),
                "hooks": self.hooks_state(), "trainer": {"bad_steps": self.bad_steps, "stopped": self.stop_reason},
                "rng": rngs}

    def load_checkpoint_state(self, state: dict) -> None:
        """Restore what `checkpoint_state` saved (this rank's RNG states).
        Raises `StageError` when the checkpoint's sampler does not match this run's."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for g in self.optimizer.param_groups:  # a schedule key: a continuation takes this run's (lr: LRScheduleHook)
            g["weight_decay"] = self.cfg.weight_decay if g.get("decay", True) else 0.0
        self.scaler.load_state_dict(state["scaler"])
        self.storage.load_state_dict(state["storage"])
        self.load_hooks_state(state["hooks"])
        self.bad_steps = int(state["trainer"]["bad_steps"])
        if self.rank < len(state["rng"]):  # elastic: ranks beyond the checkpoint's world size keep their seeds
            set_rng_state(state["rng"][self.rank])
        try:  # the sampler must be the one that produced the checkpoint; its position follows from "iter"
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as e:
            raise StageError(f"checkpoint at iteration {state['iter']}: sampler does not match this run ({e})") from None
        # elastic: the rest of the interrupted epoch (at a new world size: the samples it had not consumed)
        self.plan = EpochPlan.resumed(int(state["iter"]), self.sampler, self.iters_per_epoch, self.plan.per_step)
        self.max_iter = self.plan.max_iter(self.cfg.epochs)


def memory_mb(device: torch.device) -> float:
    """Peak memory in MiB: CUDA allocator peak on GPU, else this process's peak RSS (``ru_maxrss``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 (hex, 16 chars) over every parameter, in name order (CPU bytes).

    Buffers are left out on purpose: DDP broadcasts them from rank 0 at the start of each forward, so after
    the last forward each rank's BatchNorm running statistics are its own (rank 0's are the ones saved)."""
    h = hashlib.sha256()
    for k, v in model.named_parameters():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def build_trainer(cfg: params_mod.Train, cache_dir: Path = CACHE_DIR, arrow_meta: Path = ARROW_META,
                  ckpt_dir: Path = CKPT_DIR, live_dir: str = LIVE_DIR, extra_hooks: tuple[HookBase, ...] = (),
                  batch_plot: Path | None = None, eval_fn_factory: EvalFnFactory | None = None) -> Trainer:
    """Set up this process (distributed group, threads, seeds) and build the `Trainer` with its hooks (LR
    schedule, EMA, evaluation, metrics, checkpoints, progress, the first batch drawn to ``batch_plot`` unless it
    is None (`TrainBatchPlotHook`), then ``extra_hooks``).

    ``eval_fn_factory(cache_root, arrow_meta) -> eval_fn`` builds the `EvalHook`'s ``eval_fn(model) -> stats``
    (``{"AP": ...}``) when ``train.eval_every`` is set (the train stage passes
    `detpipe.evaluation.periodic.make_eval_fn`: the engine imports no evaluation code).
    Raises:
        StageError: missing inputs, unknown model, unusable weights; ``train.eval_every`` without ``eval_fn_factory``.
    """
    rank, world, local_rank, device = setup_distributed()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_world))
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)

    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)

    cache_root = cfg.cache_url or str(cache_dir)
    model, config, cache_meta_bytes = build_detector(cfg, arrow_meta, cache_dir)
    if is_warm_start(cfg.weights):  # exp:/checkpoint: copied by the launcher; a process without one copies it itself
        start = warm_start_path(ckpt_dir)
        if "LOCAL_RANK" not in os.environ or not start.is_file():
            materialise_weights(cfg.weights, cfg.weights_sha256, start, Path(ckpt_dir))
        load_weights(model, str(start))
    elif cfg.weights:
        load_weights(model, cfg.weights, cfg.weights_sha256)
    model.to(device).train()
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    lr = cfg.lr
    if cfg.base_batch_size:  # linear scaling rule (Goyal et al. 2017, arXiv:1706.02677)
        lr = cfg.lr * cfg.batch_size * world * cfg.accumulate / cfg.base_batch_size
    optimizer = make_optimizer(model, cfg, lr)
    dataset = CachedDetectionDataset(cache_root, "train", hflip=cfg.hflip, seed=cfg.seed,
                                     with_masks=uses_masks(model))
    recipe = resolve_augment(cfg)  # train.augment: the preset and its keys (docs/augment.md)
    if not recipe.is_flip_only:
        dataset.transforms = TrainTransforms(recipe, cfg.seed, len(dataset))
    ema = EMAHook(model, cfg.ema_decay) if cfg.ema else None
    hooks = [LRScheduleHook(optimizer, lr, cfg.warmup_iters, cfg.schedule, cfg.milestones, cfg.gamma)]
    hooks += [ema] if ema else []
    if cfg.eval_every:
        if eval_fn_factory is None:
            raise StageError("train.eval_every is set but the trainer was given no evaluation function "
                             "(build_trainer's eval_fn_factory)")
        hooks.append(EvalHook(cfg.eval_every, eval_fn_factory(cache_root, Path(arrow_meta)),
                              Path(ckpt_dir) / "best.pt", config, ema, cfg.patience, cfg.min_delta,
                              TrialReporter.from_workspace() if rank == 0 else None))
    hooks += [MetricsHook(live_dir), CheckpointHook(ckpt_dir, cfg.checkpoint_every, cfg.keep_last),
              ProgressHook(cfg.log_every_s)]
    if batch_plot is not None:
        hooks.append(TrainBatchPlotHook(batch_plot, read_meta(arrow_meta)["label_names"]))
    hooks += extra_hooks
    fp = fingerprint(cfg, cache_meta_bytes, read_meta_bytes(arrow_meta))
    return Trainer(model, optimizer, dataset, cfg, device, rank, world, config=config, fingerprint=fp, hooks=hooks)


def make_optimizer(model: torch.nn.Module, cfg: params_mod.Train, lr: float) -> torch.optim.Optimizer:
    """The optimizer of ``train.optimizer`` (``auto``: the model family's recipe, `detpipe.models.optimizer_recipe`).

    ``sgd`` with the family's backbone lr multiplier 1: one group, every trainable parameter, torch's SGD with
    ``train.momentum`` and ``train.weight_decay`` (torchvision's references/detection, the default run's optimizer).
    Otherwise up to four groups: backbone / rest x decayed / not decayed. Parameters of at most one dimension (norm
    weights, biases, the DETRs' query embeddings' 1-D terms) get no weight decay, as RT-DETR's and D-FINE's recipes
    (``weight_decay: 0`` for ``norm`` and ``bias`` parameters); the backbone's (the family's ``backbone_prefix``)
    run at ``lr x train.backbone_lr_mult``. ``adamw`` is torch's AdamW with betas (0.9, 0.999), RT-DETR's.
    Every group carries ``lr_mult`` (`LRScheduleHook` multiplies the scheduled lr by it) and ``decay`` (whether
    ``train.weight_decay`` applies: a resumed optimizer's groups take this run's value, `Trainer.load_checkpoint_state`).

    Args:
        model: the unwrapped detector (before DDP).
        cfg: train params (``optimizer``, ``backbone_lr_mult``, ``momentum``, ``weight_decay``, ``model``).
        lr: the peak learning rate (``train.lr``, scaled by ``base_batch_size`` when set).
    """
    from detpipe.models import optimizer_recipe
    kind, mult, prefix = optimizer_recipe(cfg)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "sgd" and mult == 1.0:
        group = {"params": [p for _, p in named], "lr_mult": 1.0, "decay": True}
        return torch.optim.SGD([group], lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    groups = []
    for backbone in (True, False):
        for decay in (True, False):
            ps = [p for n, p in named if n.startswith(prefix) == backbone and (p.ndim > 1) == decay]
            if ps:
                groups.append({"params": ps, "lr_mult": mult if backbone else 1.0, "decay": decay,
                               "weight_decay": cfg.weight_decay if decay else 0.0, "lr": lr * (mult if backbone else 1.0)})
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999))


def train(cfg: params_mod.Train, cache_dir: Path = CACHE_DIR, arrow_meta: Path = ARROW_META,
          ckpt_dir: Path = CKPT_DIR, model_out: Path = MODEL_OUT, live_dir: str = LIVE_DIR,
          batch_plot: Path | None = TRAIN_BATCH_PLOT, eval_fn_factory: EvalFnFactory | None = None) -> Trainer:
    """Train per ``cfg`` (one process of a torchrun job, or a single process), resuming from a matching
    checkpoint per ``train.resume``, and write ``model_out`` (rank 0) and the first batch drawn, ``batch_plot``
    (`TrainBatchPlotHook`; None: not drawn). ``eval_fn_factory``: as `build_trainer`'s (needed with
    ``train.eval_every``).

    Raises:
        StageError: missing inputs, unknown model, unusable weights, too many non-finite steps, ranks whose
        final weights differ.
        Interrupted: SIGTERM/SIGINT during training, its ``detail`` naming the iteration and the newest
        checkpoint (which is complete: checkpoints are written atomically).
    """
    trainer = build_trainer(cfg, cache_dir, arrow_meta, ckpt_dir, live_dir, batch_plot=batch_plot,
                            eval_fn_factory=eval_fn_factory)
    rank, model, ema, max_iter = trainer.rank, trainer.module, trainer.ema, trainer.max_iter
    schedule = schedule_params(cfg)
    state = find_resume_state(cfg.resume, trainer.fingerprint, ckpt_dir, schedule) if rank == 0 else None
    if trainer.distributed:
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    start_iter = 0
    if state is not None:
        trainer.load_checkpoint_state(state)
        start_iter, max_iter = int(state["iter"]), trainer.max_iter  # elastic: max_iter follows the world size
        changed = schedule_changes(state["schedule"], schedule)
        if changed and rank == 0:
            log.info("continuing the training of checkpoint iteration %d with another schedule (%s): kept the model, "
                     "optimizer moments, grad scaler, EMA, sampler position and RNG states; re-planned: iterations "
                     "%d..%d follow the lr schedule planned for %d iterations (docs/train.md, 'Continuing a run')",
                     start_iter, changed, start_iter, max_iter, max_iter)
    elif rank == 0 and Path(live_dir).exists():
        shutil.rmtree(live_dir)
    log.info("rank %d/%d on %s: %d images, %d iterations/epoch, iterations %d..%d", rank, trainer.world_size,
             trainer.device, len(trainer.dataset), trainer.iters_per_epoch, start_iter, max_iter)
    try:
        trainer.train(start_iter, max_iter)
    except BaseException as e:
        if received_signal() is None:
            raise
        if rank == 0:                       # the only writer of checkpoints; its save is over (or never began)
            remove_partial_saves(ckpt_dir)
        ckpts = list_checkpoints(ckpt_dir)
        detail = f"at iteration {trainer.iter}; " + (f"checkpoint {ckpts[-1].name} kept" if ckpts else
                                                      "no checkpoint yet")
        if isinstance(e, Interrupted):
            e.detail = detail
            raise
        raise Interrupted(received_signal(), detail) from e  # e.g. a collective failed: another rank had stopped
    check_ranks_agree(model, trainer.distributed, rank, trainer.world_size)
    if rank == 0:
        weights, source = (ema.weights() if ema else model.state_dict()), "the last" + (" EMA" if ema else "")
        if cfg.final == "best":
            best = load_model_file(Path(ckpt_dir) / "best.pt")
            weights = best["model"]
            source = f"the best (iteration {best['iters']}, val AP {best['AP']:.4f}{', EMA' if ema else ''})"
        save_model_file(Path(model_out), weights, trainer.config, trainer.iter, ema=bool(ema),
                        fingerprint=trainer.fingerprint, params=cfg.model_dump())
        stopped = f"; stopped early at iteration {trainer.iter}: {trainer.stop_reason}" if trainer.stop_reason else ""
        log.info("wrote %s after %d iterations: %s weights%s", model_out, trainer.iter, source, stopped)
    if trainer.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return trainer


def check_ranks_agree(model: torch.nn.Module, distributed: bool, rank: int, world: int) -> None:
    """Log this rank's `weights_digest`; with DDP, fail if any rank's parameters differ from rank 0's.
    Raises `StageError` naming the ranks that diverged."""
    digest = weights_digest(model)
    log.info("rank %d final weights digest %s", rank, digest)
    if not distributed:
        return
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        raise StageError(f"training: final weights of ranks {bad} differ from rank 0's ({digests})")


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
