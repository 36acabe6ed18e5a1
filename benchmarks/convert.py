"""Benchmark the convert stage against the bare validation floor, and its peak memory vs image count.

Builds COCO128 replicas in a temporary folder (copies of the image files under new names, with new image and
annotation ids; each copy holds a JPEG comment naming it, so that no two files are equal: convert drops a val image
equal to a train image), then

* times `detpipe.data.convert.convert` and the *validation floor* on the same images: the same files read and
  decoded at 1/8 scale (``PIL.Image.draft``, what convert's image check does) by a process pool with the same
  number of workers (`detpipe.core.pool`, tasks of `FLOOR_CHUNK` files), nothing written; page cache warmed for
  both, runs interleaved, best of ``--repeat``; prints images/s of each and their ratio (goal >= 0.8: convert
  costs at most 25 % more than the decode it cannot avoid);
* for information, a *decode + write floor*: the same pool and tasks, each also writing its files' bytes to one
  new file (what convert must write at least, as Arrow shards), deleted before the next run like convert's
  output. It shows what writing that much new data costs on this machine (a VM that backs fresh page-cache
  pages lazily pays that on every run), a cost the validation floor never pays;
* optionally (``--rss-sizes``) measures the peak RSS (largest process: the convert process or one of its
  workers, via ``resource.getrusage(RUSAGE_CHILDREN)`` in a fresh wrapper process) of a convert run at each
  size, next to the peak RSS of a process that only imports the stage and loads + checks the same JSON; the
  difference must not grow with the image count.

Usage: ``python -m benchmarks.convert [--images 2048] [--rss-sizes 2048 8192] [--workers N] [--repeat 3]``.
The last line is ``ratio: X`` (convert images/s / validation-floor images/s).
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from detpipe.params import Convert, load  # noqa: E402

COCO128 = REPO / "data" / "coco128"
ANN = "annotations/instances_train2017.json"

_MEASURE = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def with_comment(jpeg: bytes, text: bytes) -> bytes:
    """``jpeg`` with a comment segment (COM) after its SOI marker: the same pixels, other bytes."""
    return jpeg[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + jpeg[2:]


def build_replica(root: Path, n: int, link_from: Path | None = None) -> Path:
    """Write ``root/raw`` with ``n`` images: COCO128 copies renamed ``r{k:03d}_<name>`` (with a comment naming the
    copy, `with_comment`), image id ``k * 10^9 + id``, annotation id ``k * 10^13 + id`` (k = replica number).
    With ``link_from`` (a larger replica's raw folder) the image files are hard links to its files instead of new
    copies."""
    src = json.loads((COCO128 / ANN).read_text())
    raw = root / "raw"
    (raw / "train2017").mkdir(parents=True)
    (raw / "annotations").mkdir()
    images, anns = [], []
    k = 0
    while len(images) < n:
        by_id = {}
        for im in src["images"]:
            if len(images) >= n:
                break
            name = f"r{k:03d}_{im['file_name']}"
            dst = raw / "train2017" / name
            if link_from is not None:
                os.link(link_from / "train2017" / name, dst)
            else:
                dst.write_bytes(with_comment((COCO128 / "train2017" / im["file_name"]).read_bytes(),
                                             name.encode()))
            new = dict(im, id=k * 10**9 + im["id"], file_name=name)
            images.append(new)
            by_id[im["id"]] = new["id"]
        anns += [dict(a, id=k * 10**13 + a["id"], image_id=by_id[a["image_id"]])
                 for a in src["annotations"] if a["image_id"] in by_id]
        k += 1
    data = dict(src, images=images, annotations=anns)
    (raw / ANN).write_text(json.dumps(data))
    return raw


def warm(folder: Path) -> int:
    """Read every file once (page cache); return the total bytes."""
    total = 0
    for p in folder.iterdir():
        total += len(p.read_bytes())
    return total


def best_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def peak_rss_mb(code: str, *args: str) -> float:
    """Peak RSS (MB) of the largest process of ``python -c code args`` (measured in a fresh wrapper)."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-c", code, *args], check=True,
                         capture_output=True, text=True, cwd=REPO)
    return int(out.stdout.strip().splitlines()[-1]) / 1024.0


FLOOR_CHUNK = 64
"""Files per task of the validation floor's pool (a convert shard of COCO images holds ~400)."""


def _decode_eighth(paths: list[str]) -> int:
    """Read and decode each JPEG at 1/8 scale (``Image.draft``), as convert's check does; return the count."""
    import io

    from PIL import Image

    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as im:
            im.draft(None, (1, 1))
            im.load()
    return len(paths)


def _decode_eighth_and_write(task: tuple[list[str], str]) -> int:
    """`_decode_eighth` of ``task[0]``, then their bytes written, concatenated, to the new file ``task[1]``."""
    paths, out = task
    n = _decode_eighth(paths)
    with open(out, "wb") as f:
        for path in paths:
            with open(path, "rb") as src:
                f.write(src.read())
    return n


def validation_floor(folder: Path, workers: int, write_to: Path | None = None) -> int:
    """Decode every file of ``folder`` at 1/8 scale with ``workers`` processes (0 = here); nothing written,
    or with ``write_to`` (a new folder) also each task's file bytes to a file there. Returns the file count."""
    from detpipe.core.pool import bounded_map, process_pool

    paths = sorted(str(p) for p in folder.iterdir())
    chunks = [paths[i:i + FLOOR_CHUNK] for i in range(0, len(paths), FLOOR_CHUNK)]
    with process_pool(workers) as pool:
        if write_to is None:
            return sum(bounded_map(pool, _decode_eighth, chunks, 2 * max(1, workers), ordered=False))
        write_to.mkdir()
        tasks = [(c, str(write_to / f"{k:05d}.bin")) for k, c in enumerate(chunks)]
        return sum(bounded_map(pool, _decode_eighth_and_write, tasks, 2 * max(1, workers), ordered=False))


CONVERT_CODE = ("import sys, json; from detpipe.data.convert import convert; from detpipe.params import Convert; "
                "convert(sys.argv[1], sys.argv[2], Convert(**json.loads(sys.argv[3])), progress=False)")
JSON_ONLY_CODE = ("import sys, json, tempfile; from pathlib import Path; import detpipe.data.convert; "
                  "import detpipe.data.coco_reader as c, detpipe.data.coco_json as j; "
                  "p = Path(sys.argv[1]) / 'annotations/instances_train2017.json'; "
                  "c.index(j.read_coco(p, Path(tempfile.gettempdir())), 'train', c.Report())")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048, help="images for the throughput comparison (>= 2000)")
    ap.add_argument("--rss-sizes", type=int, nargs="*", default=[], help="image counts for the peak-RSS rows")
    ap.add_argument("--workers", type=int, default=None, help="convert.workers (default: params.yaml)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tmp", default=None, help="folder for the replicas (default: system temp)")
    args = ap.parse_args()

    base = load("convert", REPO / "params.yaml")
    workers = base.workers if args.workers is None else args.workers
    params = Convert(annotations=ANN, images="train2017", val_fraction=base.val_fraction, seed=base.seed,
                     shard_mb=base.shard_mb, workers=workers)
    from detpipe.data.convert import convert

    with tempfile.TemporaryDirectory(prefix="bench-convert-", dir=args.tmp) as tmp:
        tmp = Path(tmp)
        biggest = max([args.images, *args.rss_sizes])
        t = time.perf_counter()
        big_raw = build_replica(tmp / f"n{biggest}", biggest)
        raws = {biggest: big_raw}
        for n in {args.images, *args.rss_sizes} - {biggest}:
            raws[n] = build_replica(tmp / f"n{n}", n, link_from=big_raw)
        print(f"replicas built in {time.perf_counter() - t:.1f} s: {sorted(raws)} images", flush=True)

        raw = raws[args.images]
        nbytes = warm(raw / "train2017")
        out, written = tmp / "arrow", tmp / "written"
        floor_times, conv_times, write_times = [], [], []
        for _ in range(args.repeat):      # interleaved, so all see the same load on a shared machine
            warm(raw / "train2017")
            t = time.perf_counter()
            assert validation_floor(raw / "train2017", workers, write_to=written) == args.images
            write_times.append(time.perf_counter() - t)
            shutil.rmtree(written)          # both outputs freed a floor's run before convert starts
            shutil.rmtree(out, ignore_errors=True)
            warm(raw / "train2017")
            t = time.perf_counter()
            assert validation_floor(raw / "train2017", workers) == args.images
            floor_times.append(time.perf_counter() - t)
            warm(raw / "train2017")
            conv_times.append(best_time(lambda: convert(raw, out, params, progress=False), 1))
        result = convert(raw, out, params, progress=False)
        rows = sum(v["images"] for v in result["meta"]["splits"].values())
        assert rows == args.images, (rows, args.images)
        shutil.rmtree(out, ignore_errors=True)

        floor_s, conv_s, write_s = min(floor_times), min(conv_times), min(write_times)
        floor_ips, conv_ips = args.images / floor_s, args.images / conv_s
        print(f"images: {args.images} ({nbytes / 1e6:.1f} MB of image files), convert.workers={workers}, "
              f"shard_mb={params.shard_mb}, cpu cores={os.cpu_count()}")
        print(f"floor (1/8 decode, {workers} workers): best {floor_s:.3f} s  {floor_ips:8.1f} images/s  "
              f"(runs: {', '.join(f'{x:.3f}' for x in floor_times)})")
        print(f"decode + write floor (info):   best {write_s:.3f} s  {args.images / write_s:8.1f} images/s  "
              f"(runs: {', '.join(f'{x:.3f}' for x in write_times)})")
        print(f"convert:                       best {conv_s:.3f} s  {conv_ips:8.1f} images/s  "
              f"(runs: {', '.join(f'{x:.3f}' for x in conv_times)})")
        print(f"convert / decode + write floor (info): {write_s / conv_s:.3f}; writing {nbytes / 1e6:.0f} MB "
              f"of new files costs {write_s - floor_s:.2f} s here")

        for n in sorted(args.rss_sizes):
            out = tmp / f"arrow-rss-{n}"
            conv = peak_rss_mb(CONVERT_CODE, str(raws[n]), str(out), params.model_dump_json())
            shutil.rmtree(out, ignore_errors=True)
            only = peak_rss_mb(JSON_ONLY_CODE, str(raws[n]))
            js = (raws[n] / ANN).stat().st_size / 1e6
            print(f"peak RSS at {n:6d} images (JSON {js:5.1f} MB): convert {conv:7.1f} MB, "
                  f"import + JSON only {only:7.1f} MB, convert - JSON-only {conv - only:7.1f} MB")
        print(f"ratio: {conv_ips / floor_ips:.3f}")


if __name__ == "__main__":
    main()
