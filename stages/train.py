"""Train stage: a torchvision detector trained with DDP from the augmentation cache, resumable at any point.

``python -m stages.train`` (the DVC stage command) checks params and inputs, then launches
``torchrun --rdzv-backend c10d ... -m stages.train`` (`detpipe.launch`; under Slurm with ``train.launcher:
slurm``); each worker (detected by torchrun's ``LOCAL_RANK`` variable) trains with DDP — gloo on CPU, nccl on
CUDA. ``python -m stages.train --emit slurm|k8s`` writes the Slurm script / Kubernetes manifest instead
(README "Multi-node").

Outputs: ``checkpoints/ckpt-NNNNNNN.pt`` (kept across runs: ``persist: true`` in dvc.yaml), ``models/model.pt``
(``{"model": state_dict, "config": {...}}`` for the evaluate and export stages), ``dvclive/`` (training
curves). A checkpoint holds model, optimizer, grad scaler, every hook's state, the iteration (hence the
sampler's position in its epoch) and every rank's RNG states, plus a fingerprint of the params and data
that produced it: ``train.resume: auto`` resumes from the newest checkpoint with the same fingerprint and
otherwise starts fresh, saying why; ``never`` always starts fresh; ``must`` stops with an error when there
is nothing to resume.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from detpipe import params as params_mod
from detpipe.io import atomic_write_bytes, join_url, read_url_bytes
from detpipe.errors import StageError, run_stage
from detpipe.data import (CachedDetectionDataset, micro_batches, ResumableDistributedSampler, check_cache_masks, read_meta,
                         uses_masks)
from detpipe.hooks import (CheckpointHook, EMAHook, EvalHook, LRScheduleHook, MetricsHook, ProgressHook, Timer,
                          TrainerBase, all_reduce_flag, check_bad_steps, list_checkpoints, rng_state, save_atomic,
                          set_rng_state)
from detpipe.distributed import die_with_parent, setup_distributed
from detpipe.elastic import EpochPlan, record_samples
from detpipe import k8s, slurm
from detpipe.launch import LAUNCH_ONLY, default_run_id, launch_env, launch_local, torchrun_args
from detpipe.paths import ARROW_META, CACHE_DIR, CKPT_DIR, LIVE_DIR, MODEL as MODEL_OUT
from detpipe.models import build_from_config, load_weights, model_config

log = logging.getLogger("stages.train")


# Params that do not change the result of training: a checkpoint made with other values resumes.
_NOT_IN_FINGERPRINT = {"resume", "keep_last", "checkpoint_every", "num_workers", "threads", "log_every",
                       "eval_every"} | LAUNCH_ONLY


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
        # gradient_as_bucket_view: gradients live in the all-reduce buckets (no copy in and out per step)
        self.model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                             gradient_as_bucket_view=True) if self.distributed else model
        self.optimizer = optimizer
        self.dataset = dataset
        self.sampler = ResumableDistributedSampler(len(dataset), world_size, rank, seed=cfg.seed)
        self.iters_per_epoch = self.sampler.num_samples // (cfg.batch_size * cfg.accumulate)
        if self.iters_per_epoch == 0:
            raise StageError(f"{CACHE_DIR}/train: {len(dataset)} images is fewer than one step per rank "
                             f"(train.batch_size={cfg.batch_size} x accumulate {cfg.accumulate} x world size "
                             f"{world_size})")
        self.plan = EpochPlan(self.iters_per_epoch, cfg.batch_size * cfg.accumulate)  # elastic: see load_checkpoint_state
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16" and device.type == "cuda")
        self.bad_steps = 0
        self.metrics: dict[str, float] = {}
        self.eval_metrics: dict[str, float] = {}
        self.fingerprint = ""
        self._data = None

    def _forward(self, images, targets) -> tuple[torch.Tensor, dict]:
        # channels_last applies to the model's weights (set in build_trainer): the model's transform batches these
        # 3-D images into one 4-D tensor, and its convolutions then run channels-last.
        images = [im.to(self.device, non_blocking=True) for im in images]
        targets = [{k: t[k].to(self.device) for k in ("boxes", "labels", "masks") if k in t} for t in targets]
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            loss_dict = self.model(images, targets)
        return sum(loss_dict.values()), loss_dict

    def run_step(self) -> None:
        """One optimizer step over ``train.accumulate`` micro-batches (DDP syncs gradients on the last one).
        A non-finite loss on any rank skips the step on every rank and is counted."""
        timer = Timer()
        if self._data is None:
            self._data = micro_batches(self.dataset, self.sampler, self.iter, self.iters_per_epoch,
                                       self.cfg.batch_size, self.cfg.accumulate, self.cfg.num_workers,
                                       pin_memory=self.device.type == "cuda", locate=self.plan.locate)
        micro = next(self._data)
        record_samples(self.iter, self.plan.locate(self.iter)[0], self.rank, self.world_size, micro)
        data_time = timer.lap()
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
            self.metrics["bad_steps"] = self.bad_steps
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()
        step_time = data_time + timer.lap()
        images = self.cfg.batch_size * self.cfg.accumulate * self.world_size
        self.metrics.update({"loss": total, **terms, "data_time": data_time, "step_time": step_time,
                             "images_per_s": images / step_time, "bad_steps": self.bad_steps,
                             "memory_mb": memory_mb(self.device)})

    def checkpoint_state(self, done: int) -> dict:
        """Everything needed to continue after ``done`` completed iterations (collective across ranks)."""
        rngs = [rng_state()]
        if self.distributed:
            rngs = [None] * self.world_size
            dist.all_gather_object(rngs, rng_state())
        at_next = copy.copy(self.sampler)  # the live sampler is being iterated: leave it alone
        at_next.set_epoch(*self.plan.locate(done))
        sampler_state = at_next.state_dict(consumed=0)  # where the next iteration starts reading
        return {"format": 1, "iter": done, "fingerprint": self.fingerprint, "world_size": self.world_size,
                "sampler": sampler_state,
                "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "hooks": self.hooks_state(),
                "trainer": {"bad_steps": self.bad_steps}, "rng": rngs}

    def load_checkpoint_state(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
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


def model_kwargs(name: str, cache_meta: dict) -> dict:
    """Builder kwargs so the model's own transform keeps the cached size (no second resize).

    SSD/SSDlite resize to a fixed size set by the builder: the cache must be ``fixed`` at that size.
    The others (R-CNN, RetinaNet, FCOS) get ``min_size``/``max_size`` from the cache's resize settings.
    Raises:
        StageError: an SSD model with a cache of another size or mode.
    """
    if name.startswith("ssd"):
        native = 320 if name.startswith("ssdlite320") else 300 if name.startswith("ssd300") else None
        if cache_meta["resize"] != "fixed" or (native and cache_meta["size"] != native):
            raise StageError(f"params.yaml: {name} resizes images to {native}x{native}; set augment.resize: fixed "
                             f"and augment.size: {native} (cache has {cache_meta['resize']} {cache_meta['size']})")
        return {}
    if cache_meta["resize"] == "fixed":
        return {"min_size": cache_meta["size"], "max_size": cache_meta["size"]}
    return {"min_size": cache_meta["min_size"], "max_size": cache_meta["max_size"]}


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


def build_trainer(cfg: params_mod.Train, cache_dir: Path = CACHE_DIR, arrow_meta: Path = ARROW_META,
                  ckpt_dir: Path = CKPT_DIR, live_dir: str = LIVE_DIR) -> Trainer:
    """Set up this process (distributed group, threads, seeds) and build the `Trainer` with its hooks.

    The returned trainer also carries ``config`` (the model description), ``ema`` (the `EMAHook` or None)
    and ``planned_iters`` (``epochs * iterations per epoch``).
    Raises:
        StageError: missing inputs, unknown model, unusable weights.
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

    meta = read_meta(arrow_meta)
    cache_root = cfg.cache_url or str(cache_dir)
    cache_meta_bytes = read_cache_meta_bytes(cache_root)
    cache_meta = json.loads(cache_meta_bytes)
    config = model_config(cfg.model, int(meta["num_classes"]), **model_kwargs(cfg.model, cache_meta))
    model = build_from_config(config)
    with_masks = uses_masks(model)  # Mask R-CNN: targets carry the cached instance masks
    if with_masks:
        check_cache_masks(cache_meta, cfg.model, f"{cache_root.split('?')[0]}/meta.json")
    if cfg.weights:
        load_weights(model, cfg.weights, cfg.weights_sha256)
    model.to(device).train()
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    lr = cfg.lr
    if cfg.base_batch_size:  # linear scaling rule (Goyal et al. 2017, arXiv:1706.02677)
        lr = cfg.lr * cfg.batch_size * world * cfg.accumulate / cfg.base_batch_size
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    dataset = CachedDetectionDataset(cache_root, "train", hflip=cfg.hflip, seed=cfg.seed, with_masks=with_masks)
    trainer = Trainer(model, optimizer, dataset, cfg, device, rank, world)
    if cfg.compile:
        trainer.model = torch.compile(trainer.model)
    trainer.fingerprint = fingerprint(cfg, cache_meta_bytes, Path(arrow_meta).read_bytes())
    max_iter = cfg.epochs * trainer.iters_per_epoch
    ema = EMAHook(model, cfg.ema_decay) if cfg.ema else None
    hooks = [LRScheduleHook(optimizer, lr, cfg.warmup_iters, cfg.schedule, cfg.milestones, cfg.gamma)]
    hooks += [ema] if ema else []
    if cfg.eval_every:
        hooks.append(EvalHook(cfg.eval_every, make_eval_fn(cache_root, Path(arrow_meta)),
                              Path(ckpt_dir) / "best.pt", config, ema))
    # the metrics hook records this step's row before the checkpoint hook saves its history
    hooks += [MetricsHook(live_dir, cfg.log_every), CheckpointHook(ckpt_dir, cfg.checkpoint_every, cfg.keep_last),
              ProgressHook()]
    trainer.register_hooks(hooks)
    trainer.config, trainer.ema, trainer.planned_iters = config, ema, max_iter
    return trainer


def train(cfg: params_mod.Train, cache_dir: Path = CACHE_DIR, arrow_meta: Path = ARROW_META,
          ckpt_dir: Path = CKPT_DIR, model_out: Path = MODEL_OUT, live_dir: str = LIVE_DIR) -> Trainer:
    """Train per ``cfg`` (one process of a torchrun job, or a single process), resuming from a matching
    checkpoint per ``train.resume``, and write ``model_out`` (rank 0).

    Raises:
        StageError: missing inputs, unknown model, unusable weights, too many non-finite steps, ranks whose
        final weights differ.
    """
    if "LOCAL_RANK" in os.environ:
        die_with_parent()
    trainer = build_trainer(cfg, cache_dir, arrow_meta, ckpt_dir, live_dir)
    rank, world, model, ema = trainer.rank, trainer.world_size, trainer.module, trainer.ema
    config, max_iter, device, dataset = trainer.config, trainer.planned_iters, trainer.device, trainer.dataset
    state = find_resume_state(cfg, trainer.fingerprint, ckpt_dir) if rank == 0 else None
    if trainer.distributed:
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    start_iter = 0
    if state is not None:
        trainer.load_checkpoint_state(state)
        start_iter = int(state["iter"])
        max_iter = trainer.planned_iters = trainer.plan.max_iter(cfg.epochs)  # elastic: world size may differ
    elif rank == 0 and Path(live_dir).exists():
        shutil.rmtree(live_dir)
    log.info("rank %d/%d on %s: %d images, %d iterations/epoch, iterations %d..%d", rank, world, device,
             len(dataset), trainer.iters_per_epoch, start_iter, max_iter)
    trainer.train(start_iter, max_iter)
    check_ranks_agree(model, trainer.distributed, rank, world)
    if rank == 0:
        model_out.parent.mkdir(parents=True, exist_ok=True)
        weights = ema.weights() if ema else model.state_dict()
        save_atomic({"model": weights, "config": config, "iters": max_iter, "ema": bool(ema),
                     "fingerprint": trainer.fingerprint, "params": cfg.model_dump()}, Path(model_out))
        log.info("wrote %s after %d iterations%s", model_out, max_iter, " (EMA weights)" if ema else "")
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


def read_cache_meta_bytes(root: str) -> bytes:
    """Bytes of ``<root>/meta.json`` for a local cache directory or a URL (``s3://...``).
    Raises `StageError` naming the location when it cannot be read."""
    if "://" not in root and not (Path(root) / "meta.json").is_file():
        raise StageError(f"{Path(root) / 'meta.json'}: not found (run the augment stage first)")
    return read_url_bytes(join_url(root, "meta.json"), "train.cache_url" if "://" in root else "augment cache")


def make_eval_fn(cache_dir: str | Path, arrow_meta: Path):
    """``eval_fn(model) -> stats`` for `EvalHook`: COCO bbox stats on the val cache (see stages.evaluate)."""
    from detpipe.cocoeval import coco_evaluate
    from detpipe.evaluation import gt_from_arrow, label_to_category_id, predict

    meta = read_meta(arrow_meta)
    gt = gt_from_arrow(Path(arrow_meta).parent / "val", meta)
    dataset = CachedDetectionDataset(cache_dir, "val")
    l2c = label_to_category_id(meta)

    def eval_fn(model):  # bbox stats only: a mask model's masks are not encoded here
        return coco_evaluate(gt, predict(model, dataset, l2c, device=next(model.parameters()).device,
                                         masks=False)).stats

    return eval_fn


def check_inputs(cfg: params_mod.Train) -> None:
    """Fail fast, before launching workers, on problems every worker would hit (one-line StageError)."""
    meta = read_meta(ARROW_META)
    cache_root = cfg.cache_url or str(CACHE_DIR)
    cache_meta = json.loads(read_cache_meta_bytes(cache_root))
    model = build_from_config(model_config(cfg.model, int(meta["num_classes"]), **model_kwargs(cfg.model, cache_meta)))
    if uses_masks(model):
        check_cache_masks(cache_meta, cfg.model, f"{cache_root.split('?')[0]}/meta.json")
    if cfg.weights and "://" not in cfg.weights and not Path(cfg.weights).exists() and \
            ("/" in cfg.weights or cfg.weights.endswith((".pt", ".pth"))):
        raise StageError(f"params.yaml: key 'train.weights': file '{cfg.weights}' not found")


def launch_args(cfg: params_mod.Train, endpoint: str | None = None, run_id: str | None = None) -> list[str]:
    """torchrun arguments of this stage (see `detpipe.launch.torchrun_args`): c10d rendezvous at ``endpoint``
    (default ``train.rdzv_endpoint``) under job id ``run_id`` (default `detpipe.launch.default_run_id`)."""
    return torchrun_args(cfg, "stages.train", endpoint or cfg.rdzv_endpoint, run_id or default_run_id(cfg))


def launch(cfg: params_mod.Train) -> None:
    """``train.launcher: local``: run torchrun here (`detpipe.launch.launch_local`). ``slurm`` (outside a Slurm
    job): submit `emit`'s sbatch script, stream its log to stdout, wait; cancel the job on SIGTERM/SIGINT.
    Raises `StageError` when the job fails."""
    if cfg.launcher == "slurm" and "SLURM_JOB_ID" not in os.environ:
        slurm.run_job(emit(cfg, "slurm"), Path.cwd())
    else:
        launch_local(cfg, "stages.train")


def emit(cfg: params_mod.Train, kind: str) -> str:
    """The job description for a scheduler: ``slurm`` (an sbatch script, `detpipe.slurm.sbatch_script`) or
    ``k8s`` (a Kubeflow PyTorchJob manifest, `detpipe.k8s.pytorchjob_manifest`), for the current params."""
    if kind == "slurm":
        port = cfg.rdzv_endpoint.rsplit(":", 1)[1]
        return slurm.sbatch_script(cfg, launch_args(cfg, f"${{RDZV_HOST}}:{port}", "${SLURM_JOB_ID}"),
                                   launch_env(cfg), Path.cwd())
    job = k8s.job_name(cfg)
    return k8s.pytorchjob_manifest(cfg, job, launch_args(cfg, k8s.rdzv_endpoint(job, cfg), job), launch_env(cfg))


def main(argv: list[str] | None = None) -> None:
    """Worker (under torchrun): train. Otherwise check inputs and launch (``train.launcher``), or with
    ``--emit slurm|k8s [--out FILE]`` only write the job description for the current params."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m stages.train", description=__doc__.splitlines()[0])
    ap.add_argument("--emit", choices=["slurm", "k8s"], help="write the Slurm sbatch script or Kubernetes manifest")
    ap.add_argument("--out", type=Path, help="file to write (default: stdout)")
    args = ap.parse_args(argv)
    cfg = params_mod.load("train")
    if "LOCAL_RANK" in os.environ:
        train(cfg)
    elif args.emit:
        text = emit(cfg, args.emit)
        if args.out:
            atomic_write_bytes(args.out, text.encode())
        else:
            print(text, end="")
    else:
        check_inputs(cfg)
        launch(cfg)


if __name__ == "__main__":
    run_stage(main)
