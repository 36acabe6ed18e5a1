"""Train stage: a torchvision detector trained with DDP from the augmentation cache, resumable at any point.

``python -m stages.train`` (the DVC stage command) checks params and inputs, then launches
``torchrun --standalone --nproc-per-node ${train.nproc_per_node} -m stages.train``; each worker (detected by
torchrun's ``LOCAL_RANK`` variable) trains with DDP — gloo on CPU, nccl on CUDA. Running that ``torchrun``
line yourself works too.

Outputs: ``checkpoints/ckpt-NNNNNNN.pt`` (kept across runs: ``persist: true`` in dvc.yaml), ``models/model.pt``
(``{"model": state_dict, "config": {...}}`` for the evaluate and export stages), ``dvclive/`` (training
curves). A checkpoint holds model, optimizer, grad scaler, every hook's state, the iteration (hence the
sampler's position in its epoch) and every rank's RNG states, plus a fingerprint of the params and data
that produced it: ``train.resume: auto`` resumes from the newest checkpoint with the same fingerprint and
otherwise starts fresh, saying why; ``never`` always starts fresh; ``must`` stops with an error when there
is nothing to resume.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from stages import params as params_mod
from stages.common import StageError, run_stage
from stages.data import CachedDetectionDataset, ResumableDistributedSampler, collate, read_meta
from stages.hooks import (CheckpointHook, LRScheduleHook, MetricsHook, ProgressHook, Timer, TrainerBase,
                          all_reduce_flag, check_bad_steps, list_checkpoints, rng_state, save_atomic,
                          set_rng_state)
from stages.models import build_from_config, load_weights, model_config

log = logging.getLogger("stages.train")

CACHE_DIR = Path("data/cache")
ARROW_META = Path("data/arrow/meta.json")
CKPT_DIR = Path("checkpoints")
MODEL_OUT = Path("models/model.pt")
LIVE_DIR = "dvclive"

# Params that do not change the result of training: a checkpoint made with other values resumes.
_NOT_IN_FINGERPRINT = {"resume", "keep_last", "checkpoint_every", "num_workers", "threads"}


def fingerprint(cfg: params_mod.Train, cache_meta: bytes, arrow_meta: bytes) -> str:
    """sha256 over the training params that affect the result and the data's meta files (hex)."""
    relevant = {k: v for k, v in cfg.model_dump().items() if k not in _NOT_IN_FINGERPRINT}
    h = hashlib.sha256(json.dumps(relevant, sort_keys=True).encode())
    h.update(cache_meta)
    h.update(arrow_meta)
    return h.hexdigest()


class Trainer(TrainerBase):
    """Plain SGD detection trainer over `CachedDetectionDataset` (see `TrainerBase` for the loop)."""

    def __init__(self, model, optimizer, dataset, cfg: params_mod.Train, device: torch.device,
                 rank: int, world_size: int):
        super().__init__()
        self.cfg, self.device, self.rank, self.world_size = cfg, device, rank, world_size
        self.distributed = world_size > 1
        self.module = model
        self.model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) \
            if self.distributed else model
        self.optimizer = optimizer
        self.dataset = dataset
        self.sampler = ResumableDistributedSampler(len(dataset), world_size, rank, seed=cfg.seed)
        self.iters_per_epoch = self.sampler.num_samples // cfg.batch_size
        if self.iters_per_epoch == 0:
            raise StageError(f"{CACHE_DIR}/train: {len(dataset)} images is fewer than one batch per rank "
                             f"(train.batch_size={cfg.batch_size} x world size {world_size})")
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16" and device.type == "cuda")
        self.bad_steps = 0
        self.metrics: dict[str, float] = {}
        self.fingerprint = ""
        self._data = None

    def _batches(self):
        it = self.iter
        while True:
            epoch, pos = divmod(it, self.iters_per_epoch)
            self.sampler.set_epoch(epoch, pos * self.cfg.batch_size)
            self.dataset.set_epoch(epoch)
            loader = DataLoader(self.dataset, batch_size=self.cfg.batch_size, sampler=self.sampler,
                                num_workers=self.cfg.num_workers, collate_fn=collate, drop_last=True,
                                pin_memory=self.device.type == "cuda")
            for batch in loader:
                yield batch
                it += 1

    def run_step(self) -> None:
        timer = Timer()
        if self._data is None:
            self._data = self._batches()
        images, targets = next(self._data)
        data_time = timer.lap()
        images = [im.to(self.device, non_blocking=True) for im in images]
        targets = [{"boxes": t["boxes"].to(self.device), "labels": t["labels"].to(self.device)} for t in targets]
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            loss_dict = self.model(images, targets)
        loss = sum(loss_dict.values())
        self.optimizer.zero_grad(set_to_none=True)
        if all_reduce_flag(not bool(torch.isfinite(loss)), self.distributed, self.device):
            self.bad_steps += 1
            log.warning("iteration %d: non-finite loss %s, step skipped (%d so far)", self.iter,
                        {k: float(v) for k, v in loss_dict.items()}, self.bad_steps)
            check_bad_steps(self.bad_steps, self.cfg.max_bad_steps, self.iter)
            return
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        step_time = data_time + timer.lap()
        self.metrics.update({"loss": float(loss.detach()), **{k: float(v.detach()) for k, v in loss_dict.items()},
                             "data_time": data_time, "step_time": step_time,
                             "images_per_s": self.cfg.batch_size * self.world_size / step_time,
                             "bad_steps": self.bad_steps})

    def checkpoint_state(self, done: int) -> dict:
        """Everything needed to continue after ``done`` completed iterations (collective across ranks)."""
        rngs = [rng_state()]
        if self.distributed:
            rngs = [None] * self.world_size
            dist.all_gather_object(rngs, rng_state())
        return {"format": 1, "iter": done, "fingerprint": self.fingerprint, "world_size": self.world_size,
                "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "hooks": self.hooks_state(),
                "trainer": {"bad_steps": self.bad_steps}, "rng": rngs}

    def load_checkpoint_state(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.load_hooks_state(state["hooks"])
        self.bad_steps = int(state["trainer"]["bad_steps"])
        set_rng_state(state["rng"][self.rank])


def find_resume_state(cfg: params_mod.Train, fp: str, ckpt_dir: Path = CKPT_DIR) -> dict | None:
    """The newest readable checkpoint in ``ckpt_dir`` made with fingerprint ``fp``, per ``train.resume``.

    Returns the loaded checkpoint dict, or None to start fresh (checkpoints of other params are then
    deleted, and the reason logged).
    Raises:
        StageError: ``resume: must`` and no matching checkpoint.
    """
    for stale in Path(ckpt_dir).glob(".ckpt-*.tmp-*"):  # a save interrupted by a kill
        stale.unlink(missing_ok=True)
    ckpts = list_checkpoints(ckpt_dir)
    if cfg.resume == "never":
        reason = "train.resume is 'never'"
    elif not ckpts:
        reason = f"no checkpoint in {ckpt_dir}/"
    else:
        for path in reversed(ckpts):
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # truncated or foreign file: try the previous one
                log.warning("%s: unreadable checkpoint (%s), trying an older one", path, e)
                continue
            if state.get("fingerprint") == fp:
                log.info("resuming from %s (iteration %d)", path, state["iter"])
                return state
            reason = (f"{path} was made with other training params or data (fingerprint "
                      f"{str(state.get('fingerprint'))[:12]} != {fp[:12]})")
            break
        else:
            reason = f"no readable checkpoint in {ckpt_dir}/"
    if cfg.resume == "must":
        raise StageError(f"train.resume is 'must' but there is nothing to resume: {reason}")
    if ckpts:
        log.info("starting fresh: %s; removing %d old checkpoint(s)", reason, len(ckpts))
        for p in ckpts:
            p.unlink(missing_ok=True)
    else:
        log.info("starting fresh: %s", reason)
    return None


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when its launcher dies (``prctl(PR_SET_PDEATHSIG)``), so a
    ``kill -9`` of the stage never leaves orphan workers writing checkpoints beside a resumed run."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def setup_distributed() -> tuple[int, int, int, torch.device]:
    """Init the process group from torchrun's env (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``): nccl with one
    GPU per local rank when CUDA is available, else gloo. Returns ``(rank, world_size, local_rank, device)``."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, local_rank, device


def train(cfg: params_mod.Train, cache_dir: Path = CACHE_DIR, arrow_meta: Path = ARROW_META,
          ckpt_dir: Path = CKPT_DIR, model_out: Path = MODEL_OUT, live_dir: str = LIVE_DIR) -> Trainer:
    """Train per ``cfg`` (one process of a torchrun job, or a single process) and write ``model_out``.

    Raises:
        StageError: missing inputs, unknown model, unusable weights, too many non-finite steps.
    """
    if "LOCAL_RANK" in os.environ:
        die_with_parent()
    rank, world, local_rank, device = setup_distributed()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_world))
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)

    meta = read_meta(arrow_meta)
    cache_meta_path = Path(cache_dir) / "meta.json"
    read_meta(cache_meta_path)
    config = model_config(cfg.model, int(meta["num_classes"]))
    model = build_from_config(config)
    if cfg.weights:
        load_weights(model, cfg.weights, cfg.weights_sha256)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    dataset = CachedDetectionDataset(cache_dir, "train", hflip=cfg.hflip, seed=cfg.seed)
    trainer = Trainer(model, optimizer, dataset, cfg, device, rank, world)
    trainer.fingerprint = fingerprint(cfg, cache_meta_path.read_bytes(), Path(arrow_meta).read_bytes())
    max_iter = cfg.epochs * trainer.iters_per_epoch
    trainer.register_hooks([
        LRScheduleHook(optimizer, cfg.lr, cfg.warmup_iters),
        CheckpointHook(ckpt_dir, cfg.checkpoint_every, cfg.keep_last),
        MetricsHook(live_dir),
        ProgressHook(),
    ])

    state = find_resume_state(cfg, trainer.fingerprint, ckpt_dir) if rank == 0 else None
    if trainer.distributed:
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    start_iter = 0
    if state is not None:
        trainer.load_checkpoint_state(state)
        start_iter = int(state["iter"])
    elif rank == 0 and Path(live_dir).exists():
        shutil.rmtree(live_dir)
    log.info("rank %d/%d on %s: %d images, %d iterations/epoch, iterations %d..%d", rank, world, device,
             len(dataset), trainer.iters_per_epoch, start_iter, max_iter)
    trainer.train(start_iter, max_iter)
    if rank == 0:
        model_out.parent.mkdir(parents=True, exist_ok=True)
        save_atomic({"model": model.state_dict(), "config": config, "iters": max_iter,
                     "fingerprint": trainer.fingerprint}, Path(model_out))
        log.info("wrote %s after %d iterations", model_out, max_iter)
    if trainer.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return trainer


def check_inputs(cfg: params_mod.Train) -> None:
    """Fail fast, before launching workers, on problems every worker would hit (one-line StageError)."""
    meta = read_meta(ARROW_META)
    read_meta(CACHE_DIR / "meta.json")
    build_from_config(model_config(cfg.model, int(meta["num_classes"])))
    if cfg.weights and "://" not in cfg.weights and not Path(cfg.weights).exists() and \
            ("/" in cfg.weights or cfg.weights.endswith((".pt", ".pth"))):
        raise StageError(f"params.yaml: key 'train.weights': file '{cfg.weights}' not found")


def launch(cfg: params_mod.Train) -> None:
    """Run ``torchrun --standalone --nproc-per-node N -m stages.train`` in-process; a failed worker becomes
    a one-line error (its own message is printed above by the worker)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    argv = ["--standalone", "--nproc-per-node", str(cfg.nproc_per_node), "-m", "stages.train"]
    log.info("launching: torchrun %s", " ".join(argv))
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = next(iter(e.failures.items()))
        raise StageError(f"training failed: rank {rank} exited with code {failure.exitcode} "
                         f"(see its message above)") from None


def main() -> None:
    cfg = params_mod.load("train")
    if "LOCAL_RANK" in os.environ:
        train(cfg)
    else:
        check_inputs(cfg)
        launch(cfg)


if __name__ == "__main__":
    run_stage(main)
