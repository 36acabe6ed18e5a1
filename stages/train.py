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

The work itself is `detpipe.trainer.train`. Without a terminal, a progress line (iteration/total, epoch, loss, lr,
images/s, ETA) is logged every ``train.log_every_s`` seconds. SIGTERM or SIGINT stops training with one line
``error: interrupted by SIGTERM at iteration N; checkpoint ckpt-NNNNNNN.pt kept`` and exit status 128 + signal;
that checkpoint is complete (written atomically) and the next run resumes from it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from detpipe import params as params_mod
from detpipe.data import check_cache_masks, read_meta, uses_masks
from detpipe.distributed import launch_module
from detpipe.errors import StageError, run_stage
from detpipe.models import build_from_config, model_config
from detpipe.paths import ARROW_META, CACHE_DIR
from detpipe.trainer import model_kwargs, read_cache_meta_bytes, train


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


def launch_args(cfg: params_mod.Train) -> list[str]:
    """torchrun arguments built from params: ``--standalone`` on one node; with ``train.nnodes > 1`` a static
    rendezvous at ``train.rdzv_endpoint`` (node 0's host:port) with ``--node-rank train.node_rank``."""
    if cfg.nnodes == 1:
        head = ["--standalone"]
    else:
        host, port = cfg.rdzv_endpoint.rsplit(":", 1)
        head = ["--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank), "--master-addr", host,
                "--master-port", port]
    return head + ["--nproc-per-node", str(cfg.nproc_per_node), "-m", "stages.train"]


def launch(cfg: params_mod.Train) -> None:
    """Run torchrun with `launch_args` in-process (see `launch_module`)."""
    launch_module(launch_args(cfg))


def main() -> None:
    cfg = params_mod.load("train")
    if "LOCAL_RANK" in os.environ:
        train(cfg)
    else:
        check_inputs(cfg)
        launch(cfg)


if __name__ == "__main__":
    run_stage(main)
