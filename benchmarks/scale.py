"""Benchmark: convert + augment on a synthetic COCO-sized dataset, and what COCO train2017 / Objects365 would cost.

For each ``N`` of ``--images`` (default 2000 8000 32000): COCO128's 128 images replicated under fresh image ids,
annotation ids and file names (copies of the JPEG files, each with a JPEG comment naming it: the same pixels, but no
two files equal, since convert drops a val image equal to a train image), one COCO JSON of N images with their
annotations; then the real ``python -m stages.convert`` and ``python -m
stages.augment`` CLIs with the repository's params.yaml (``--encoding``/``--resize`` override the augment
section). Per stage it prints wall seconds, the peak RSS (``ru_maxrss`` of the stage process and its workers,
from ``os.wait4``) and the bytes written (``data/arrow``, ``data/cache``). Finally a least-squares line
``a + b * N`` per figure and its extrapolation to COCO train2017 (118,287 images) and Objects365 (1,742,289 images,
v2 train) on this machine.

    python -m benchmarks.scale --images 2000 8000 [32000] [--encoding jpeg|raw] [--resize fixed|keep_ratio]

Last line: ``ratio: <cache bytes per image ÷ source JPEG bytes per image>`` at the largest N (informational; the
cache-size goal is `benchmarks.cache_size`'s).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._workdir import env  # noqa: E402
from benchmarks.convert import with_comment  # noqa: E402

COCO128 = ROOT / "data" / "coco128"
TARGETS = {"COCO train2017": 118_287, "Objects365 v2 train": 1_742_289}


def synthesize(raw: Path, n: int) -> int:
    """Write ``raw/annotations/instances_train2017.json`` and ``raw/train2017/*.jpg`` (distinct copies, see
    `benchmarks.convert.with_comment`) for ``n`` images replicated from COCO128; return the source JPEG bytes."""
    src = json.loads((COCO128 / "annotations/instances_train2017.json").read_text())
    images = sorted(src["images"], key=lambda im: im["id"])
    by_image: dict[int, list[dict]] = {}
    for a in src["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    (raw / "annotations").mkdir(parents=True)
    (raw / "train2017").mkdir()
    jpegs = {im["file_name"]: (COCO128 / "train2017" / im["file_name"]).read_bytes() for im in images}
    out_images, out_anns, total, ann_id = [], [], 0, 1
    for k in range(n):
        im = images[k % len(images)]
        new_id = k + 1
        name = f"{new_id:012d}.jpg"
        blob = with_comment(jpegs[im["file_name"]], name.encode())
        (raw / "train2017" / name).write_bytes(blob)
        total += len(blob)
        out_images.append({**im, "id": new_id, "file_name": name})
        for a in by_image.get(im["id"], []):
            out_anns.append({**a, "id": ann_id, "image_id": new_id})
            ann_id += 1
    (raw / "annotations/instances_train2017.json").write_text(
        json.dumps({**src, "images": out_images, "annotations": out_anns}))
    return total


def run_stage(name: str, cwd: Path) -> tuple[float, int]:
    """Run ``python -m stages.<name>`` in ``cwd``; return (wall seconds, peak RSS in bytes)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", f"stages.{name}"], cwd=cwd, env={**env(), "TQDM_DISABLE": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"stages.{name} failed ({proc.returncode}): {err[-2000:]}")
    return seconds, usage.ru_maxrss * 1024


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, nargs="+", default=[2000, 8000, 32000])
    ap.add_argument("--encoding", choices=("jpeg", "raw"), default=None, help="default: params.yaml's")
    ap.add_argument("--resize", choices=("fixed", "keep_ratio"), default=None, help="default: params.yaml's")
    args = ap.parse_args()
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key in ("encoding", "resize"):
        if getattr(args, key):
            params["augment"][key] = getattr(args, key)
    a = params["augment"]
    print(f"augment: {a['encoding']}, {a['resize']} "
          f"{a['size'] if a['resize'] == 'fixed' else str(a['min_size']) + '/' + str(a['max_size'])}; workers: convert "
          f"{params['convert']['workers']}, augment {a['workers']}; {os.cpu_count()} CPUs", flush=True)
    rows = []
    for n in args.images:
        work = Path(tempfile.mkdtemp(prefix=f"detpipe-scale-{n}-"))
        try:
            source = synthesize(work / "data/raw", n)
            (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
            conv_s, conv_rss = run_stage("convert", work)
            aug_s, aug_rss = run_stage("augment", work)
            row = {"n": n, "source": source, "convert_s": conv_s, "convert_rss": conv_rss,
                   "arrow": folder_bytes(work / "data/arrow"), "augment_s": aug_s, "augment_rss": aug_rss,
                   "cache": folder_bytes(work / "data/cache")}
            rows.append(row)
            print(f"N={n}: source {source / 1e6:.0f} MB; convert {conv_s:.1f} s, peak RSS {conv_rss / 2**20:.0f} MiB, "
                  f"arrow {row['arrow'] / 1e6:.0f} MB; augment {aug_s:.1f} s, peak RSS {aug_rss / 2**20:.0f} MiB, "
                  f"cache {row['cache'] / 1e6:.0f} MB", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    ns = np.array([r["n"] for r in rows], dtype=np.float64)
    fits = {}
    for key, unit, scale in (("convert_s", "s", 1), ("augment_s", "s", 1), ("convert_rss", "MiB", 2**20),
                             ("augment_rss", "MiB", 2**20), ("arrow", "MB", 1e6), ("cache", "MB", 1e6)):
        ys = np.array([r[key] for r in rows], dtype=np.float64) / scale
        b, a0 = np.polyfit(ns, ys, 1) if len(rows) > 1 else (ys[0] / ns[0], 0.0)
        fits[key] = (a0, b)
        print(f"fit {key}: {a0:.3g} {unit} + {b * 1000:.4g} {unit} per 1000 images", flush=True)
    for name, n in TARGETS.items():
        est = {k: a0 + b * n for k, (a0, b) in fits.items()}
        print(f"{name} ({n:,} images), extrapolated: convert {est['convert_s'] / 3600:.2f} h, augment "
              f"{est['augment_s'] / 3600:.2f} h, arrow {est['arrow'] / 1e3:.1f} GB, cache {est['cache'] / 1e3:.1f} GB, "
              f"peak RSS convert {est['convert_rss']:.0f} MiB / augment {est['augment_rss']:.0f} MiB", flush=True)
    last = rows[-1]
    print(f"ratio: {last['cache'] / last['source']:.3f}")


if __name__ == "__main__":
    main()
