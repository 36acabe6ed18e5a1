"""Benchmark: peak memory of the convert stage as the dataset grows (issue 26: convert in bounded memory).

Synthetic COCO datasets of N distinct images: the 128 COCO128 records (sizes, annotations) cycled under fresh
image ids, annotation ids and file names; each image file is its COCO128 photo re-encoded once at JPEG quality
30 (a base per record), the copies made distinct by a JPEG comment naming the copy (other bytes, same pixels, so
no copy is a duplicate or a split leak). Plus one file of ``--many-mb`` MB with ``--many-per-image`` annotations
per image (each image's COCO128 annotations repeated under new ids). The files are cached in ``--cache``
(default ``/tmp/detpipe-bench-convert-memory``): built once, reused by later runs.

Each dataset is converted once by ``detpipe.data.convert.convert`` (params.yaml's convert section: workers,
shard_mb, val_fraction, seed) in a fresh process; the row gives wall seconds and the peak RSS of the largest
process (the stage or one of its workers: ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` in a wrapper
process), next to the JSON's size. ``--repo`` measures another checkout's convert on the same data (e.g. a git
worktree of an older commit).

    python -m benchmarks.convert_memory [--sizes 2000 32000 128000] [--many-mb 500] [--many-per-image 400]

With ``--yolo`` (default; ``--no-yolo`` to skip) each size is converted again from a YOLO copy of the same
dataset (``convert.format: yolo``, `detpipe.data.yolo_reader`): ``<cache>/yolo_n<N>/`` holds a ``data.yaml`` whose
``train`` is a ``.txt`` list of the N images, ``images`` a link to the same image folder and ``labels`` a link to
``<cache>/yolo_labels/`` (each COCO128 record's boxes normalized by its size; records without annotations get no
label file); no ``val`` (split by val_fraction, as the COCO rows).

Last lines: ``ratio (yolo): Y`` and ``ratio: X``, peak RSS at the largest of ``--ratio-sizes`` (default 32000) /
at the smallest (2000) (goal <= 1.5).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.convert import ANN, COCO128, CONVERT_CODE, with_comment  # noqa: E402
from detpipe.params import Convert, load  # noqa: E402

_MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); subprocess.run(sys.argv[1:], "
            "check=True); print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def build_images(folder: Path, n: int) -> None:
    """``folder/<k:07d>.jpg`` for k < n (see the module docstring); kept if already complete."""
    from PIL import Image

    done = folder / ".complete"
    if done.is_file() and int(done.read_text()) >= n:
        return
    folder.mkdir(parents=True, exist_ok=True)
    src = json.loads((COCO128 / ANN).read_text())
    bases = []
    for im in sorted(src["images"], key=lambda im: im["id"]):
        with Image.open(COCO128 / "train2017" / im["file_name"]) as pic:
            buf = io.BytesIO()
            pic.convert("RGB").save(buf, "JPEG", quality=30)
        bases.append(buf.getvalue())
    for k in range(n):
        (folder / f"{k:07d}.jpg").write_bytes(with_comment(bases[k % len(bases)], b"copy %d" % k))
    done.write_text(str(n))


def build_json(path: Path, n: int, per_image: int | None = None) -> None:
    """A COCO file of images ``0..n-1`` (COCO128 record ``k % 128``); their COCO128 annotations, or (``per_image``)
    that many per image, the record's own repeated (records without annotations get none)."""
    if path.is_file():
        return
    src = json.loads((COCO128 / ANN).read_text())
    records = sorted(src["images"], key=lambda im: im["id"])
    by_image: dict[int, list] = {}
    for a in src["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    images, anns = [], []
    for k in range(n):
        rec = records[k % len(records)]
        images.append({**rec, "id": k + 1, "file_name": f"{k:07d}.jpg"})
        own = by_image.get(rec["id"], [])
        for a in (own * (per_image // len(own) + 1))[:per_image] if per_image and own else own:
            anns.append({**a, "id": len(anns) + 1, "image_id": k + 1})
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps({**src, "images": images, "annotations": anns}))
    tmp.rename(path)


def build_yolo(cache: Path, raw: Path, n: int, n_labels: int) -> Path:
    """The YOLO copy of the first ``n`` images of ``raw/train2017`` (see the module docstring); returns its root."""
    labels = cache / "yolo_labels"
    done = labels / ".complete"
    if not (done.is_file() and int(done.read_text()) >= n_labels):
        labels.mkdir(parents=True, exist_ok=True)
        src = json.loads((COCO128 / ANN).read_text())
        records = sorted(src["images"], key=lambda im: im["id"])
        cat_index = {c["id"]: k for k, c in enumerate(sorted(src["categories"], key=lambda c: c["id"]))}
        text = {}
        for a in src["annotations"]:
            im = next(r for r in records if r["id"] == a["image_id"])
            x, y, w, h = a["bbox"]
            W, H = im["width"], im["height"]
            text.setdefault(a["image_id"], []).append(
                f"{cat_index[a['category_id']]} {(x + w / 2) / W:.6f} {(y + h / 2) / H:.6f} {w / W:.6f} {h / H:.6f}")
        for k in range(n_labels):
            lines = text.get(records[k % len(records)]["id"])
            if lines:
                (labels / f"{k:07d}.txt").write_text("\n".join(lines) + "\n")
        done.write_text(str(n_labels))
    root = cache / f"yolo_n{n}"
    if not (root / "data.yaml").is_file():
        root.mkdir(parents=True, exist_ok=True)
        for name, target in (("images", raw / "train2017"), ("labels", labels)):
            if not (root / name).is_symlink():
                (root / name).symlink_to(target.resolve())
        (root / "train.txt").write_text("".join(f"./images/{k:07d}.jpg\n" for k in range(n)))
        src = json.loads((COCO128 / ANN).read_text())
        names = [c["name"] for c in sorted(src["categories"], key=lambda c: c["id"])]
        (root / "data.yaml").write_text(json.dumps({"train": "train.txt", "names": names}))   # JSON is YAML
    return root


def measure(repo: Path, raw: Path, annotations: str, params: Convert, out: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB of the largest process) of one convert of ``raw`` by ``repo``'s code."""
    p = params.model_copy(update={"annotations": annotations})
    env = {**os.environ, "PYTHONPATH": str(repo), "TQDM_DISABLE": "1"}
    res = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-c", CONVERT_CODE, str(raw), str(out),
                          p.model_dump_json()], cwd=repo, env=env, check=True, capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    seconds, rss = res.stdout.split()[-2:]
    return float(seconds), int(rss) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[2000, 32000, 128000], help="image counts")
    ap.add_argument("--ratio-sizes", type=int, nargs=2, default=[2000, 32000], help="the ratio's two sizes")
    ap.add_argument("--many-mb", type=float, default=500, help="size of the many-annotations JSON (0: none)")
    ap.add_argument("--many-per-image", type=int, default=400, help="its annotations per image")
    ap.add_argument("--cache", default="/tmp/detpipe-bench-convert-memory", help="dataset cache folder")
    ap.add_argument("--repo", default=str(REPO), help="checkout whose convert is measured")
    ap.add_argument("--yolo", action=argparse.BooleanOptionalAction, default=True,
                    help="also convert a YOLO copy of each size (convert.format: yolo)")
    args = ap.parse_args()
    sizes = sorted(set(args.sizes) | set(args.ratio_sizes))
    base = load("convert", REPO / "params.yaml")
    params = Convert(annotations=ANN, images="train2017", val_fraction=base.val_fraction, seed=base.seed,
                     shard_mb=base.shard_mb, workers=base.workers)
    raw = Path(args.cache) / "raw"
    (raw / "annotations").mkdir(parents=True, exist_ok=True)
    per_image_bytes = 600 * args.many_per_image          # ~600 bytes per COCO128 annotation
    many = round(args.many_mb * 1e6 / per_image_bytes) if args.many_mb else 0
    t = time.perf_counter()
    build_images(raw / "train2017", max(sizes + [many]))
    for n in sizes:
        build_json(raw / "annotations" / f"n{n}.json", n)
    if many:
        build_json(raw / "annotations" / f"many{many}x{args.many_per_image}.json", many, args.many_per_image)
    print(f"datasets ready in {time.perf_counter() - t:.1f} s ({args.cache}); convert of {args.repo}: "
          f"workers={params.workers}, shard_mb={params.shard_mb}, {os.cpu_count()} CPUs; load {os.getloadavg()}",
          flush=True)
    rss = {}
    runs = [(f"n{n}.json", n, None) for n in sizes] + ([(f"many{many}x{args.many_per_image}.json", many,
                                                         args.many_per_image)] if many else [])
    for name, n, per in runs:
        ann = raw / "annotations" / name
        seconds, peak = measure(Path(args.repo), raw, f"annotations/{name}", params, Path(args.cache) / "out")
        if per is None:
            rss[n] = peak
        anns = "COCO128's" if per is None else f"{per} per image"
        print(f"N={n:7d} images ({anns} annotations), JSON {ann.stat().st_size / 1e6:7.1f} MB: convert "
              f"{seconds:7.1f} s ({n / seconds:6.0f} images/s), peak RSS {peak:7.1f} MiB; load {os.getloadavg()[0]:.2f}",
              flush=True)
    small, large = sorted(args.ratio_sizes)
    if args.yolo:
        yolo_rss = {}
        for n in sizes:
            root = build_yolo(Path(args.cache), raw, n, max(sizes))
            seconds, peak = measure(Path(args.repo), root, ANN, params.model_copy(update={"format": "yolo"}),
                                    Path(args.cache) / "out")
            yolo_rss[n] = peak
            print(f"N={n:7d} images (COCO128's annotations), YOLO labels: convert {seconds:7.1f} s "
                  f"({n / seconds:6.0f} images/s), peak RSS {peak:7.1f} MiB ({peak / rss[n]:.2f} x COCO's); "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
        print(f"ratio (yolo): {yolo_rss[large] / yolo_rss[small]:.3f}")
    print(f"ratio: {rss[large] / rss[small]:.3f}")


if __name__ == "__main__":
    main()
