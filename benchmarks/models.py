"""Benchmark: the model families side by side on one machine, same run: parameters, train images/s at 320 px on the
CPU, ONNX and int8 predict images/s, and val AP after an equal CPU training budget from random init.

One COCO128 working directory (convert + augment of ``--images`` images by the stages' own CLIs, the repository's
params.yaml: ``augment.resize: fixed``, 320 px; 3/4 train, 1/4 val), then for every model of ``--models`` (the
first is the baseline, default ``ssdlite320_mobilenet_v3_large``):

1. parameters, and train images/s: `detpipe.models.build_detector` + the trainer's `make_optimizer` on the first
   ``train.batch_size`` cached train images (forward, backward, optimizer step; one warm-up step, then
   ``--steps`` timed, in this process);
2. the equal budget: ``train.epochs`` = ``--budget-s`` x that rate / train images (at least 1), trained by the real
   train stage (``python -m stages.train``, random init, the family's optimizer; RT-DETRv2/D-FINE with
   ``train.lr 0.0001``, ``weight_decay 0.0001``), scored by the real evaluate stage (COCO AP on val); each row also
   gives the train stage's wall seconds (process start and loading included);
3. unless ``--no-export``: the real export stage (``export.formats: [int8]``, ``int8_method: plain``,
   ``on_gate_fail: skip``: a barely trained model may fail the int8 gate, then the int8 column says so), and predict
   images/s of ``models/model.onnx`` and ``models/int8/model.int8.onnx`` with `detpipe.predict.load_runner`'s runner
   over the val images (batch 8, one warm-up batch, decoding excluded: `benchmarks.predict.model_only`).

    python -m benchmarks.models [--budget-s 120] [--models ssdlite320_mobilenet_v3_large rtdetr_v2_tiny dfine_tiny]

Prints one row per model and as the last line ``ratio: <best non-baseline AP / baseline AP>`` (``nan`` when the
baseline's AP is 0). From random init on ~100 images and minutes of CPU, AP says little about the architectures;
the row shows what a fixed CPU budget buys on this machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._workdir import env, temporary_workdir  # noqa: E402

BASELINE = "ssdlite320_mobilenet_v3_large"


def train_rate(work: Path, train: dict, steps: int) -> tuple[int, float]:
    """(parameters, train images/s) of ``train["model"]`` on ``work``'s cache (see the module docstring)."""
    import torch

    from detpipe.data.dataset import CachedDetectionDataset
    from detpipe.engine.trainer import make_optimizer
    from detpipe.models import build_detector
    from detpipe.params import Train

    cfg = Train(**{**yaml.safe_load((work / "params.yaml").read_text())["train"], **train})
    torch.manual_seed(0)
    model, _, _ = build_detector(cfg, work / "data/arrow/meta.json", work / "data/cache")
    model.train()
    opt = make_optimizer(model, cfg, cfg.lr)
    data = CachedDetectionDataset(work / "data/cache", "train")
    batch = [data[i] for i in range(min(cfg.batch_size, len(data)))]
    images = [im for im, _ in batch]
    targets = [{"boxes": t["boxes"], "labels": t["labels"]} for _, t in batch]

    def step():
        loss = sum(model(images, targets).values())
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    rate = steps * len(images) / (time.perf_counter() - t0)
    return sum(p.numel() for p in model.parameters()), rate


def run_stage(work: Path, stage: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=work, env=env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"{stage} failed in {work}:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def predict_rate(work: Path, rel: str) -> float | None:
    """Images/s of the runner of ``work/rel`` over the val images (None when the file is absent)."""
    from benchmarks.predict import model_only
    from detpipe.data.dataset import CachedDetectionDataset

    if not (work / rel).is_file():
        return None
    val = CachedDetectionDataset(work / "data/cache", "val")
    images = [val[i][0] for i in range(len(val))]
    return len(images) / model_only(work / rel, images, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=120, help="CPU training seconds per model (equal budget)")
    ap.add_argument("--models", nargs="+", default=[BASELINE, "rtdetr_v2_tiny", "dfine_tiny"],
                    help="the first is the baseline of the ratio")
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps for train images/s")
    ap.add_argument("--no-export", action="store_true", help="skip export and the ONNX / int8 columns")
    args = ap.parse_args()
    from detpipe.models import family_of

    with temporary_workdir(args.images) as base:
        n_train = json.loads((base / "data/cache/meta.json").read_text())["splits"]["train"]["rows"]
        aps = {}
        for name in args.models:
            train = {"model": name, "resume": "never", "checkpoint_every": 10_000}
            if family_of(name).optimizer == "adamw":
                train.update(lr=0.0001, weight_decay=0.0001)
            work = base / f"run-{name}"
            shutil.copytree(base / "data", work / "data")
            params = yaml.safe_load((base / "params.yaml").read_text())
            params["train"].update(train)
            params.setdefault("export", {}).update(formats=["int8"], int8_method="plain", on_gate_fail="skip")
            (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
            n_params, rate = train_rate(work, train, args.steps)
            epochs = max(1, round(args.budget_s * rate / n_train))
            params["train"]["epochs"] = epochs
            (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
            seconds = run_stage(work, "train")
            run_stage(work, "evaluate")
            stats = json.loads((work / "metrics/eval.json").read_text())["bbox"]
            aps[name] = stats["AP"]
            cols = "onnx -, int8 -"
            if not args.no_export:
                run_stage(work, "export")
                onnx, int8 = (predict_rate(work, r) for r in ("models/model.onnx", "models/int8/model.int8.onnx"))
                cols = (f"onnx {onnx:.1f} img/s, " if onnx else "onnx none, ") + \
                       (f"int8 {int8:.1f} img/s" if int8 else "int8 none (gate failed: export_report.json)")
            print(f"{name}: params {n_params:,}, train {rate:.2f} img/s, {cols}, {epochs} epochs "
                  f"({seconds:.0f} s train stage), AP {stats['AP']:.4f}, AP50 {stats['AP50']:.4f}", flush=True)
        baseline, others = args.models[0], args.models[1:]
        best = max(others, key=lambda m: aps[m]) if others else baseline
        print(f"best new model: {best}")
        print(f"ratio: {aps[best] / aps[baseline]:.2f}" if aps[baseline] > 0 else "ratio: nan")


if __name__ == "__main__":
    main()
