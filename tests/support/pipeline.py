"""Pipeline working copies for tests: tiny params, COCO128 subsets, the stages' own CLIs, trained models.

A working directory's ``params.yaml`` is written (`write_params`) and changed (`set_params`) here, and its
``checkpoints/`` read through the trainer's own naming (`checkpoints`, `checkpoint_iterations`, `checkpoint`)."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import yaml

from support.procs import REPO, run, stage_env

COCO128 = REPO / "data" / "coco128"

# Tiny settings: a few images, a few iterations; every stage still runs for real.
TINY_PARAMS = {
    "convert": {"val_fraction": 0.25, "workers": 0},
    "augment": {"workers": 0},
    "train": {"epochs": 2, "batch_size": 4, "checkpoint_every": 2, "warmup_iters": 1, "lr": 0.01,
              "threads": 1, "augment": "flip"},  # the presets: tests/unit/test_train_transforms.py, test_train.py
    "evaluate": {"batch_size": 4},
    "export": {"num_images": 2},
}


def stage_cli(name: str, cwd: Path, check: bool = True, timeout: float = 600,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m stages.<name>`` in ``cwd`` with ``env`` added to the environment (`support.procs.run`:
    with ``check``, a failure shows its output)."""
    return run([sys.executable, "-m", f"stages.{name}"], cwd, env=env, check=check, timeout=timeout)


def write_params(workdir: Path, overrides: dict | None = None, tiny: bool = True) -> dict:
    """Write ``params.yaml`` into ``workdir``: the repository's params with ``TINY_PARAMS`` (unless ``tiny`` is
    false) and ``overrides`` merged per section. Returns the params dict."""
    return _merge_params(workdir, yaml.safe_load((REPO / "params.yaml").read_text()),
                         TINY_PARAMS if tiny else {}, overrides or {})


def set_params(workdir: Path, overrides: dict) -> dict:
    """Update ``workdir/params.yaml`` in place: ``overrides`` merged per section into what the file holds (the
    other keys as they are). Returns the params dict."""
    return _merge_params(workdir, yaml.safe_load((workdir / "params.yaml").read_text()), overrides)


def _merge_params(workdir: Path, params: dict, *layers: dict) -> dict:
    for layer in layers:
        for section, values in layer.items():
            params[section].update(values)
    (workdir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return params


def checkpoints(workdir: Path) -> list[Path]:
    """``workdir/checkpoints/ckpt-NNNNNNN.pt``, oldest iteration first, as the trainer lists them
    (`detpipe.engine.checkpoints.list_checkpoints`; [] without the folder)."""
    from detpipe.engine.checkpoints import list_checkpoints

    return list_checkpoints(workdir / "checkpoints")


def checkpoint_iterations(workdir: Path) -> list[int]:
    """The iterations of `checkpoints` (``ckpt-0000004.pt`` -> 4), oldest first."""
    return [int(p.stem.rsplit("-", 1)[1]) for p in checkpoints(workdir)]


def checkpoint(workdir: Path, iteration: int) -> Path:
    """``workdir/checkpoints/ckpt-NNNNNNN.pt`` of ``iteration`` (`detpipe.engine.checkpoints.checkpoint_path`),
    whether it exists or not."""
    from detpipe.engine.checkpoints import checkpoint_path

    return checkpoint_path(workdir / "checkpoints", iteration)


def read_rows(out: Path, split: str = "train") -> list[dict]:
    """The rows of the convert output ``out``'s ``split`` (``data/arrow``), in shard order, as dicts; asserts each
    shard's schema is `detpipe.data.convert.SCHEMA`."""
    import pyarrow as pa

    from detpipe.data.convert import SCHEMA

    meta = json.loads((out / "meta.json").read_text())
    rows = []
    for shard in meta["splits"][split]["shards"]:
        with pa.memory_map(str(out / shard)) as src:
            table = pa.ipc.open_file(src).read_all()
        assert table.schema.equals(SCHEMA)
        rows += table.to_pylist()
    return rows


def make_coco_subset(dest: Path, n_images: int = 12) -> dict:
    """Copy the first ``n_images`` COCO128 images (sorted by id) with their annotations into ``dest`` in the
    layout of ``data/raw`` (``annotations/instances_train2017.json``, ``train2017/``). Returns the JSON."""
    src = json.loads((COCO128 / "annotations" / "instances_train2017.json").read_text())
    images = sorted(src["images"], key=lambda im: im["id"])[:n_images]
    ids = {im["id"] for im in images}
    subset = {**src, "images": images, "annotations": [a for a in src["annotations"] if a["image_id"] in ids]}
    (dest / "annotations").mkdir(parents=True, exist_ok=True)
    (dest / "train2017").mkdir(parents=True, exist_ok=True)
    (dest / "annotations" / "instances_train2017.json").write_text(json.dumps(subset))
    for im in images:
        shutil.copyfile(COCO128 / "train2017" / im["file_name"], dest / "train2017" / im["file_name"])
    return subset


# The "learns" data (tests/stages/test_learns.py, the `fitted_workdir` fixture): COCO128 images with one or two large
# objects of four classes: zebra (34), dog (42), giraffe (72), elephant (263); 4 images, 7 objects, 4 classes +
# background. Train and val are the same images: val is a copy of the train JSON whose image and annotation ids are
# offset by `LEARNS_ID_OFFSET` (``convert.val_annotations``), so it is converted and cached like any explicit val split;
# its files are copies holding a JPEG comment (the same pixels, other bytes: convert drops val files equal to train's).
LEARNS_IMAGE_IDS = (34, 42, 72, 263)
LEARNS_ID_OFFSET = 10**6
LEARNS_ITERATIONS = 150


def make_learns_workdir(work: Path) -> dict:
    """``work/data/raw`` with the `LEARNS_IMAGE_IDS` images in ``images/``, ``annotations/train.json`` (their COCO
    records, only their 4 categories), ``annotations/val.json`` (the same, ids offset by `LEARNS_ID_OFFSET`) and
    ``val_images/`` (the same images, each with a JPEG comment segment after its SOI marker: same pixels);
    ``work/params.yaml`` training ssdlite320_mobilenet_v3_large for `LEARNS_ITERATIONS` iterations on all of them
    at once. Returns the train JSON."""
    src = json.loads((COCO128 / "annotations" / "instances_train2017.json").read_text())
    images = [im for im in src["images"] if im["id"] in LEARNS_IMAGE_IDS]
    anns = [a for a in src["annotations"] if a["image_id"] in LEARNS_IMAGE_IDS]
    cats = {a["category_id"] for a in anns}
    train = {"images": images, "annotations": anns, "categories": [c for c in src["categories"] if c["id"] in cats]}
    val = {**train, "images": [dict(im, id=im["id"] + LEARNS_ID_OFFSET) for im in images],
           "annotations": [dict(a, id=a["id"] + LEARNS_ID_OFFSET, image_id=a["image_id"] + LEARNS_ID_OFFSET)
                           for a in anns]}
    raw = work / "data" / "raw"
    (raw / "annotations").mkdir(parents=True)
    (raw / "images").mkdir()
    (raw / "val_images").mkdir()
    (raw / "annotations" / "train.json").write_text(json.dumps(train))
    (raw / "annotations" / "val.json").write_text(json.dumps(val))
    comment = b"val copy"
    for im in images:
        data = (COCO128 / "train2017" / im["file_name"]).read_bytes()
        (raw / "images" / im["file_name"]).write_bytes(data)
        (raw / "val_images" / im["file_name"]).write_bytes(
            data[:2] + b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment + data[2:])
    n = len(LEARNS_IMAGE_IDS)
    write_params(work, {
        "convert": {"annotations": "annotations/train.json", "images": "images",
                    "val_annotations": "annotations/val.json", "val_images": "val_images"},
        "train": {"model": "ssdlite320_mobilenet_v3_large", "epochs": LEARNS_ITERATIONS, "batch_size": n,
                  "lr": 0.05, "warmup_iters": 5, "weight_decay": 0.0, "hflip": 0.0, "threads": 1,
                  "checkpoint_every": LEARNS_ITERATIONS, "log_every": LEARNS_ITERATIONS},
        "evaluate": {"batch_size": n, "num_plot_images": 0}})
    return train


# The learns test for the transformers family (`detpipe.models.transformers_family`): the same 4 images and
# params as `make_learns_workdir`'s, cached at 128 px, training `rtdetr_v2_tiny` with AdamW (the family's recipe,
# the backbone at the full lr: it starts from random weights too). Figures: docs/train.md, "Proof the new family
# learns".
LEARNS_DETR_ITERATIONS = 200
LEARNS_DETR = {"augment": {"size": 128},
               "train": {"model": "rtdetr_v2_tiny", "epochs": LEARNS_DETR_ITERATIONS, "lr": 0.002,
                         "backbone_lr_mult": 1.0, "augment": "flip",
                         "checkpoint_every": LEARNS_DETR_ITERATIONS, "log_every": LEARNS_DETR_ITERATIONS}}


# D-FINE (`dfine_tiny`: its two feature levels are 1/16 and 1/32 of the input, so it needs more pixels): 192 px,
# 300 iterations at lr 0.003. Measured: clean AP50 1.000 / AP 0.777, labels+1 AP50 0.209 / AP 0.137.
LEARNS_DFINE_ITERATIONS = 300
LEARNS_DFINE = {"augment": {"size": 192},
                "train": {**LEARNS_DETR["train"], "model": "dfine_tiny", "epochs": LEARNS_DFINE_ITERATIONS, "lr": 0.003,
                          "checkpoint_every": LEARNS_DFINE_ITERATIONS, "log_every": LEARNS_DFINE_ITERATIONS}}


def make_learns_detr_workdir(prepared: Path, work: Path, params: dict | None = None) -> Path:
    """A copy of ``prepared`` (`make_learns_workdir` after convert and augment) with ``params`` (default
    `LEARNS_DETR`), its cache rebuilt at their size by the real augment stage. Returns ``work``."""
    shutil.copytree(prepared, work)
    set_params(work, params or LEARNS_DETR)
    stage_cli("augment", work)
    return work


def recalibrated_model(work: Path):
    """Load ``work/models/model.pt`` and recalibrate its BatchNorm statistics on the training cache (cumulative
    average over all images). After a few tiny training steps the running statistics are still near their initial
    values, so outputs barely depend on the image; tests that need image-dependent, well-separated scores (export
    parity) start from this and sharpen the logits. Returns ``(model in eval mode, checkpoint dict)``."""
    import torch
    from detpipe.data.dataset import CachedDetectionDataset
    from detpipe.models import build_from_config

    ckpt = torch.load(work / "models/model.pt", weights_only=True)
    model = build_from_config(ckpt["config"])
    model.load_state_dict(ckpt["model"])
    model.eval()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    train = CachedDetectionDataset(work / "data/cache", "train")
    with torch.no_grad():
        model([train[i][0] for i in range(len(train))])
    for m in bns:
        m.eval()
    return model, ckpt


# Elastic and cluster tests (tests/system/test_elastic.py, tests/system/test_cluster.py): 9 training images, 2 per micro-batch,
# a checkpoint per iteration: 2 iterations per epoch with 2 ranks, 4 with 1.
ELASTIC_TRAIN = {"epochs": 2, "batch_size": 2, "checkpoint_every": 1, "keep_last": 50, "threads": 1,
                 "warmup_iters": 1}


def elastic_workdir(cached: Path, dest: Path, train: dict) -> Path:
    """A copy of `cached_workdir`'s data with params ``ELASTIC_TRAIN`` + ``train``."""
    shutil.copytree(cached / "data", dest / "data")
    write_params(dest, {"train": {**ELASTIC_TRAIN, **train}})
    return dest


@contextlib.contextmanager
def stage_in_background(name: str, cwd: Path, timeout: float = 600, env: dict | None = None
                        ) -> Iterator[subprocess.Popen]:
    """Run ``python -m stages.<name>`` in ``cwd`` (`stage_env` + ``env``) while the ``with`` block runs (an
    uninterrupted reference run beside the one a test interrupts: with tiny params a stage keeps one core of two
    busy); leaving the block waits for it and fails the test with its output unless it exited 0, else sets the
    process's ``output`` (stdout and stderr merged, text). Killed (its process group) if the block raises."""
    import os
    import signal
    import tempfile

    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", f"stages.{name}"], cwd=cwd, env=stage_env(env), stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            yield proc
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        proc.output = log.read()
        assert proc.returncode == 0, f"stages.{name} in {cwd} failed ({proc.returncode}):\n{proc.output[-3000:]}"


def kill9_training_after(work: Path, iteration: int = 2, timeout_s: float = 300, die_s: float = 30) -> None:
    """Run ``python -m stages.train`` in ``work`` and ``kill -9`` it as soon as the checkpoint of ``iteration``
    exists (`checkpoint`; asserting training was still running then); return once every process it had started
    is gone too.

    Its torchrun workers (which write the checkpoints) die with it (PR_SET_PDEATHSIG), a moment after it: the
    callers read ``checkpoints/`` as the kill left it, so this waits for those very processes (at most ``die_s``
    seconds; a zombie counts as gone) rather than sleeping a fixed time."""
    import signal
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=work, env=stage_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout_s
    while not checkpoint(work, iteration).exists():
        assert proc.poll() is None and time.time() < deadline, "training ended before it could be killed"
        time.sleep(0.05)
    tree = psutil.Process(proc.pid).children(recursive=True)   # the workers exist: one of them wrote the checkpoint
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def running(p: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        return False

    deadline = time.time() + die_s
    while left := [p for p in tree if running(p)]:
        assert time.time() < deadline, f"processes of the killed training still running after {die_s} s: {left}"
        time.sleep(0.05)


def assert_same_training_state(a_path: Path, b_path: Path) -> int:
    """Two checkpoints hold the same training state bit for bit: iteration, every weight and every tensor of the
    optimizer's state (SGD's momentum buffers; AdamW's step, exp_avg and exp_avg_sq) (`torch.equal`); returns the
    iteration. Fails the test naming the first tensor that differs."""
    import torch

    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    assert a["iter"] == b["iter"], (a["iter"], b["iter"])
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for k in sa:
        assert sa[k].keys() == sb[k].keys() and sa[k], (k, sa[k].keys(), sb[k].keys())
        for name in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][name]), torch.as_tensor(sb[k][name])), (k, name)
    return a["iter"]
