"""Benchmark: how far apart convert's perceptual hashes put distinct images and modified copies (the default of
``convert.leak_distance``, rule ``val_near_duplicate``; docs/convert.md, "Near-duplicate leaks").

On the 128 real COCO128 images, with the product's own hashing (`detpipe.data.imageio.inspect` with
``phash=True``: ImageHash's 64-bit pHash of the whole frame and of its central 90 %, on the 1/8-scale JPEG
decode) and distance (`detpipe.data.leaks.nearest_train`: the smallest of whole vs whole, whole vs central
part, central part vs whole):

* distinct images: for each image its nearest other COCO128 image (128 nearest-neighbour distances), and every
  pair (8,128);
* modified copies, each image against its own original: saved again at JPEG quality 70 (``q70``), resized by 0.9
  (``resize``), cropped by 5 % of the width and height on each side (``crop``), all three (``all``: crop, resize,
  then quality 70); copies other than q70 are saved at quality 95. For information (not in the ratio): crops of
  2 % and 8 % per side, a 5 % crop of one side only, a PNG copy and a mirrored copy (which pHash does not match);
* for information, a larger sample of distinct pictures: the four quadrants of each image, every pair of
  quadrants of different images (130,048 pairs), with the whole-frame hash alone and with the pair: the share of
  pairs at each distance or below, i.e. how often an unrelated train image would fall within a threshold, which
  grows with the number of train images each val image is compared with.

Each line gives the distances' count per value (``{bits: images}``), min, max (for the copies also the distance
of the whole-frame hashes alone, which a crop defeats); the last line is ``ratio: X``: the
smallest distance between two distinct COCO128 images / the largest distance of a modified copy (q70, resize,
crop, all) from its original (> 1: a threshold separates them; ``convert.leak_distance`` should lie between).

    python -m benchmarks.leak_threshold
"""
from __future__ import annotations

import collections
import io
import os
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from detpipe.data.imageio import inspect, preload_phash  # noqa: E402
from detpipe.params import Convert  # noqa: E402

IMAGES = REPO / "data" / "coco128" / "train2017"


def hashes(data: bytes) -> tuple[int, int]:
    """The product's `detpipe.data.imageio.phash_pair` of an encoded image, as convert computes it."""
    return inspect(data, phash=True).phash


def distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    """`detpipe.data.leaks.nearest_train`'s distance between two images' hash pairs."""
    return min(bin(a[0] ^ b[0]).count("1"), bin(a[0] ^ b[1]).count("1"), bin(a[1] ^ b[0]).count("1"))


def encode(im: Image.Image, fmt: str = "JPEG", quality: int = 95) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def crop(im: Image.Image, left: float, top: float, right: float, bottom: float) -> Image.Image:
    w, h = im.size
    return im.crop((round(w * left), round(h * top), round(w * (1 - right)), round(h * (1 - bottom))))


def resize(im: Image.Image, f: float) -> Image.Image:
    return im.resize((round(im.width * f), round(im.height * f)), Image.Resampling.BILINEAR)


COPIES = {
    "q70": lambda im: encode(im, quality=70),
    "resize": lambda im: encode(resize(im, 0.9)),
    "crop": lambda im: encode(crop(im, .05, .05, .05, .05)),
    "all": lambda im: encode(resize(crop(im, .05, .05, .05, .05), 0.9), quality=70),
}
INFO_COPIES = {
    "crop 2 %": lambda im: encode(crop(im, .02, .02, .02, .02)),
    "crop 8 %": lambda im: encode(crop(im, .08, .08, .08, .08)),
    "crop 5 % left only": lambda im: encode(crop(im, .05, 0, 0, 0)),
    "png": lambda im: encode(im, "PNG"),
    "mirrored": lambda im: encode(im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)),
}


def summary(values) -> str:
    values = list(values)
    counts = dict(sorted(collections.Counter(values).items()))
    return f"min {min(values):2d} max {max(values):2d} {counts}"


def main() -> None:
    files = sorted(IMAGES.glob("*.jpg"))
    print(f"{len(files)} COCO128 images; convert.leak_distance default {Convert.model_fields['leak_distance'].default};"
          f" load {os.getloadavg()}", flush=True)
    preload_phash()
    t = time.perf_counter()
    own = [hashes(f.read_bytes()) for f in files]
    print(f"hashing (1/8-scale decode + 2 pHashes): {(time.perf_counter() - t) / len(files) * 1e3:.2f} ms per image",
          flush=True)
    n = len(own)
    pairs = np.array([[distance(own[i], own[j]) if i != j else 99 for j in range(n)] for i in range(n)])
    nn = pairs.min(axis=1)
    print(f"distinct, nearest other image ({n}): {summary(nn.tolist())}")
    upper = pairs[np.triu_indices(n, 1)]
    print(f"distinct, all pairs ({len(upper)}), up to 24 bits: {summary(upper.tolist())[:13]} "
          f"{ {d: c for d, c in sorted(collections.Counter(upper.tolist()).items()) if d <= 24} }")
    worst = 0
    for name, make in {**COPIES, **INFO_COPIES}.items():
        dists, whole = [], []
        for f, h in zip(files, own):
            with Image.open(f) as im:
                got = hashes(make(im.convert("RGB")))
            dists.append(distance(got, h))
            whole.append(bin(got[0] ^ h[0]).count("1"))
        if name in COPIES:
            worst = max(worst, max(dists))
        print(f"copy {name:>20s} ({'in the ratio' if name in COPIES else 'information'}): {summary(dists)}; "
              f"whole-frame hash alone: min {min(whole)} max {max(whole)} median {int(np.median(whole))}", flush=True)
    quads, photo = [], []
    for k, f in enumerate(files):
        with Image.open(f) as im:
            im = im.convert("RGB")
            for x, y in ((0, 0), (1, 0), (0, 1), (1, 1)):
                quads.append(hashes(encode(crop(im, x / 2, y / 2, (1 - x) / 2, (1 - y) / 2))))
                photo.append(k)
    both = collections.Counter()
    whole = collections.Counter()
    for i in range(len(quads)):
        for j in range(i + 1, len(quads)):
            if photo[i] != photo[j]:
                both[distance(quads[i], quads[j])] += 1
                whole[bin(quads[i][0] ^ quads[j][0]).count("1")] += 1
    total = sum(both.values())
    for name, counts in (("whole frame only", whole), ("whole + central part", both)):
        cum = {t: sum(c for d, c in counts.items() if d <= t) for t in range(6, 22, 2)}
        print(f"quadrant pairs of different images ({total}), {name}: share at <= bits: "
              + ", ".join(f"{t}: {c / total:.1e} ({c})" for t, c in cum.items()))
    print(f"smallest distinct distance {nn.min()}, largest copy distance {worst}; load {os.getloadavg()}")
    print(f"ratio: {nn.min() / max(worst, 1):.3f}")


if __name__ == "__main__":
    main()
