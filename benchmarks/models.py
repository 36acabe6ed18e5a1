"""Benchmark: the model families side by side on one machine, same run: parameters, train images/s at 320 px on the
CPU, ONNX and int8 predict images/s, and val AP after an equal training budget (iterations) from random init.

Every stage and the predict timing run with ``--threads`` torch threads (default 1: on a 2-core machine shared with
other jobs, two OpenMP threads per process ran ssdlite ~50x slower than on a quiet machine; docs/measurements.md).

One COCO128 working directory (convert + augment of ``--images`` images by the stages' own CLIs, the repository's
params.yaml: ``augment.resize: fixed``, 320 px; COCO128's split, 102 train / 26 val at 128 images), then for every
model of ``--models`` (the first is the baseline, default ``ssdlite320_mobilenet_v3_large``), one after the other:

1. parameters: `detpipe.models.build_detector` on the meta device (structure only, no initialization);
2. the equal budget, in iterations, not seconds: every model trains ``--epochs`` epochs of batch ``train.batch_size``
   (16) on the same train images, so each sees the same images the same number of times (``iterations`` =
   epochs x (train images // 16)); a budget of CPU or wall seconds would give each model what the other jobs on a
   shared machine left it. Trained by the real train stage (``python -m stages.train``, random init,
   ``train.augment: auto``: the family's preset, ``train.optimizer: auto``: the family's recipe: ssdlite
   params.yaml's SGD lr 0.05, weight decay 4e-5; RT-DETRv2 / D-FINE AdamW lr 1e-4, weight decay 1e-4, backbone lr
   x 0.1, the papers'), scored by the real evaluate stage (COCO AP@[.5:.95] and AP50 on val);
3. train images/s: from that training itself, batch size / the median of the trainer's own ``step_time`` (forward,
   backward, optimizer step; data loading excluded) over its iterations after the first, read from its DVCLive
   log; also the train stage's wall and CPU seconds (`resource.getrusage` of the child: process start, loading and
   every step included);
4. unless ``--no-export``: the real export stage (ONNX with its parity gate; ``export.formats: [int8]``,
   ``int8_method: plain``, ``calibration_images`` 32, ``torch_export: false``, ``on_gate_fail: skip``: a barely
   trained model may fail the int8 gate, then the int8 column says so), then predict images/s of
   ``models/model.onnx`` and ``models/int8/model.int8.onnx`` with `detpipe.predict.load_runner`'s runner over the
   val images (batch 8, one warm-up batch, decoding excluded: `benchmarks.predict.model_only`).

    nice -n 10 python -m benchmarks.models [--epochs 2] [--models ssdlite320_mobilenet_v3_large rtdetr_v2_r18vd ...]

Prints one row per model, then ``best new model: <name>`` and as the last line ``ratio: X`` (`ratio`): the best
non-baseline AP / the baseline's AP. When the baseline's AP is 0 the quotient is undefined: ``inf`` when a new model
scored above 0, ``nan`` when every AP is 0 (then the budget is too small to rank anything: raise ``--epochs``).
From random init on ~100 images and a few dozen iterations, AP says little about the architectures (the papers'
figures are 72-300 COCO epochs); the rows show what an equal, small training budget buys on this machine.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._workdir import env, temporary_workdir  # noqa: E402

BASELINE = "ssdlite320_mobilenet_v3_large"
MODELS = [BASELINE, "dfine_n", "dfine_s", "rtdetr_v2_r18vd"]  # cheapest first: a cut-short run keeps most rows


def ratio(aps: dict[str, float], baseline: str) -> tuple[str, float]:
    """``(best new model, AP ratio)`` over ``aps`` (model name -> COCO AP, 0-1): the best AP of the models other than
    ``baseline`` divided by ``baseline``'s; ``inf`` when the baseline's AP is 0 and the best new one's is not, ``nan``
    when both are 0 (undefined: nothing learned at this budget). With ``baseline`` alone its own name and 1.0."""
    others = [m for m in aps if m != baseline] or [baseline]
    best = max(others, key=lambda m: aps[m])
    if aps[baseline] > 0:
        return best, aps[best] / aps[baseline]
    return best, math.inf if aps[best] > 0 else math.nan


def parameters(work: Path, name: str) -> int:
    """Parameter count of ``name`` as the train stage builds it for ``work``'s cache (meta device: no memory)."""
    from detpipe.models import build_detector
    from detpipe.params import Train

    cfg = Train(**yaml.safe_load((work / "params.yaml").read_text())["train"])
    model, _, _ = build_detector(cfg, work / "data/arrow/meta.json", work / "data/cache", device="meta")
    return sum(p.numel() for p in model.parameters())


def run_stage(work: Path, stage: str, check: bool = True) -> tuple[float, float]:
    """``(wall seconds, CPU seconds)`` of ``python -m stages.<stage>`` in ``work`` (CPU: user + system of the stage's
    processes, `resource.getrusage` of the children).

    Raises:
        SystemExit: the stage failed and ``check`` (its stderr's tail); without ``check`` a failure returns
            ``(nan, nan)`` after printing that tail (the row then says so).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=work, env=env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        if check:
            raise SystemExit(f"{stage} failed in {work}:\n{proc.stderr[-3000:]}")
        print(f"{stage} failed in {work}:\n{proc.stderr[-1500:]}", flush=True)
        return math.nan, math.nan
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def step_rate(work: Path, batch_size: int) -> tuple[float, int]:
    """``(train images/s, iterations)`` of the train stage run in ``work``: ``batch_size`` / the median ``step_time``
    (seconds) of its DVCLive log after the first iteration (warm-up), and the number of iterations logged."""
    rows = list(csv.DictReader((work / "dvclive/plots/metrics/train/step_time.tsv").open(), delimiter="\t"))
    times = [float(r["step_time"]) for r in rows]
    return batch_size / statistics.median(times[1:] or times), len(times)


def predict_rate(work: Path, rel: str) -> float | None:
    """Images/s of the runner of ``work/rel`` over the val images (None when the file is absent)."""
    from benchmarks.predict import model_only
    from detpipe.data.dataset import CachedDetectionDataset

    if not (work / rel).is_file():
        return None
    val = CachedDetectionDataset(work / "data/cache", "val")
    images = [val[i][0] for i in range(len(val))]
    try:
        return len(images) / model_only(work / rel, images, 8)
    except Exception as e:  # noqa: BLE001 - a file the runner cannot run is a row's finding, not the run's end
        print(f"predict {work / rel}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2,
                    help="the equal budget: epochs of the train split per model (iterations = epochs x train // 16)")
    ap.add_argument("--models", nargs="+", default=MODELS, help="the first is the baseline of the ratio")
    ap.add_argument("--images", type=int, default=128, help="COCO128 images (its split: ~4/5 train, ~1/5 val)")
    ap.add_argument("--no-export", action="store_true", help="skip export and the ONNX / int8 columns")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of every stage and of the predict timing (train.threads, OMP_NUM_THREADS)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (path printed to stderr)")
    args = ap.parse_args()
    started = time.perf_counter()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the stages' processes (env() copies os.environ)
    import torch

    torch.set_num_threads(args.threads)  # the predict timing, in this process
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, --epochs {args.epochs}", flush=True)
    with temporary_workdir(args.images, keep=args.keep) as base:
        aps = {}
        for name in args.models:
            work = base / f"run-{name}"
            shutil.copytree(base / "data", work / "data")
            params = yaml.safe_load((base / "params.yaml").read_text())
            params["train"].update(model=name, epochs=args.epochs, resume="never", checkpoint_every=10_000,
                                   threads=args.threads)
            from detpipe.models import family_of

            if family_of(name).optimizer == "adamw":
                params["train"].update(lr=0.0001, weight_decay=0.0001)
            params["export"].update(formats=["int8"], int8_method="plain", on_gate_fail="skip",
                                    torch_export=False, calibration_images=32)
            (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
            n_params = parameters(work, name)
            load = os.getloadavg()[0]
            wall, cpu = run_stage(work, "train")
            rate, iters = step_rate(work, params["train"]["batch_size"])
            run_stage(work, "evaluate")
            stats = json.loads((work / "metrics/eval.json").read_text())["bbox"]
            aps[name] = stats["AP"]
            cols = "onnx -, int8 -"
            if not args.no_export:
                export_wall, _ = run_stage(work, "export", check=False)
                onnx, int8 = (predict_rate(work, r) for r in ("models/model.onnx", "models/int8/model.int8.onnx"))
                cols = (f"onnx {onnx:.1f} img/s, " if onnx is not None else "onnx none, ") + \
                       (f"int8 {int8:.1f} img/s" if int8 is not None else "int8 none (gate failed: export_report.json)") + \
                       f" (export stage {export_wall:.0f} s)"
            print(f"{name}: params {n_params:,}, train {rate:.2f} img/s, {cols}, {iters} iterations "
                  f"(train stage {wall:.0f} s wall, {cpu:.0f} s CPU, load {load:.1f}), "
                  f"AP {stats['AP']:.6f}, AP50 {stats['AP50']:.6f}", flush=True)
    best, r = ratio(aps, args.models[0])
    print(f"wall {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f}")
    print(f"best new model: {best}")
    print(f"ratio: {r:.2f}")


if __name__ == "__main__":
    main()
