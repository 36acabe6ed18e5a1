"""Run the exported or the trained detector on images: ``python -m detpipe.predict SOURCE [options]``.

``SOURCE`` is one image file, a folder (the files directly in it), a glob (``"photos/*.jpg"``,
``"data/**/*.png"``: quote it), an ``http(s)://`` URL of one image, or an ``s3://`` (or any fsspec) URL of a
file, a prefix (folder) or a glob. Every listed file is read and decoded with the pipeline's own decoder
(`detpipe.data.imageio.decode_rgb`: EXIF orientation applied, 16-bit / float / palette / CMYK / alpha images
to 8-bit RGB), then prepared exactly as the augment stage prepared the training and val images
(`prepare`: the resize rule of ``data/cache/meta.json``, bilinear with antialias, and the JPEG round trip
of a ``jpeg`` cache), so the model sees what it was trained and evaluated on.

The model is ``models/model.onnx`` (default; run with onnxruntime on the CPU, the file the export stage
wrote and parity-checked) or ``models/model.pt`` (``--model models/model.pt``: the trained eager PyTorch
model, batched). Boxes come back in the prepared image's pixels and are mapped to the original image's pixels
with the cache's rule ``orig = prepared / scale`` (`detpipe.evaluation.coco_evaluation.predict` does the same
on the cache), labels to the dataset's COCO category ids and names with ``data/arrow/meta.json``.

Writes into ``--out`` (default ``predictions/``):

* ``predictions.json``: COCO results (a JSON list, as ``COCO.loadRes`` takes), one dict per detection with
  score >= ``--score-threshold``: ``image_id`` (int, 1.. in the sorted order of the listed files),
  ``file_name`` (path relative to the source folder), ``category_id`` (the dataset's id), ``category_name``,
  ``bbox`` ``[x, y, w, h]`` (float, original-image pixels, clipped to the image), ``score`` (float in [0, 1]);
* ``images/<file stem>.jpg``: each image at its original size with its boxes and ``name score`` drawn;
* ``report.json``: counts, the skipped files with the reason, the images (``id``, ``file_name``, ``width``,
  ``height``: a COCO ``images`` list), the runtime, seconds and images/s.

Each output is replaced atomically (`detpipe.files.atomic_dir`, `detpipe.files.atomic_write_json`): an
interrupted run leaves the previous outputs as they were. A file that cannot be read or decoded (corrupt, not an
image) is skipped, counted and named in the log and in ``report.json``; a missing model, missing data meta files
or a source with no files is a one-line error (exit status 2).

Batches: ``--batch-size`` images are decoded (in threads) and run together; the eager model takes them as one
batch, the ONNX file (one ``(3, H, W)`` image per call: `detpipe.export.exporter.DetectionExport`'s signature)
one after the other.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import os
import posixpath
import time
from pathlib import Path
from typing import Callable

import torch

from detpipe import params as params_mod
from detpipe.data.augmentation import encode_pixels, resize_pixels, target_size
from detpipe.data.dataset import decode_images
from detpipe.data.meta import read_meta
from detpipe.data.imageio import decode_rgb
from detpipe.errors import StageError, run_program
from detpipe.evaluation.coco_evaluation import label_to_category_id
from detpipe.files import (atomic_dir, atomic_write_json, fsspec_filesystem, is_url, read_url_bytes, redact_url,
                           url_protocol)
from detpipe.pool import bounded_map
from detpipe.progress import Progress

log = logging.getLogger("detpipe.predict")

DEFAULT_MODEL = Path("models/model.onnx")
DEFAULT_DATA = Path("data")
DEFAULT_OUT = Path("predictions")
SCORE_THRESHOLD = 0.25  # default --score-threshold (Ultralytics' ``conf`` default)
BATCH_SIZE = 8
PREPROCESS_KEYS = ("resize", "size", "min_size", "max_size", "upscale", "encoding", "jpeg_quality")
_GLOB_CHARS = "*?["


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One listed input: ``file_name`` (POSIX path relative to the source's folder, as written to the outputs),
    ``location`` (what to read: a local path, a URL, or a path inside ``fs``), ``fs`` (fsspec filesystem, or None
    to read ``location`` with `detpipe.files.read_url_bytes`)."""

    file_name: str
    location: str
    fs: object = None

    def read(self) -> bytes:
        """The file's bytes (any exception of the filesystem propagates: the caller counts a skip)."""
        return read_url_bytes(self.location, "predict source") if self.fs is None else self.fs.cat_file(self.location)


@dataclasses.dataclass
class Prepared:
    """One decoded image ready for the model.

    ``image``: ``float32 (3, h, w)`` RGB in [0, 1], h and w the prepared size in pixels; ``pixels``: the decoded
    original, ``uint8 (3, H, W)`` RGB (for drawing); ``scale``: ``(scale_y, scale_x)`` prepared pixels per original
    pixel (``h / H``, ``w / W``)."""

    image: torch.Tensor
    pixels: torch.Tensor
    scale: tuple[float, float]

    @property
    def orig_size(self) -> tuple[int, int]:
        """``(H, W)`` of the original image in pixels (after EXIF orientation)."""
        return int(self.pixels.shape[1]), int(self.pixels.shape[2])


def list_sources(source: str, endpoint_url: str | None = None) -> list[SourceFile]:
    """The files of ``source``, sorted by ``file_name``.

    Args:
        source: a local file, folder (its files, not its subfolders), or glob; an ``http(s)://`` URL (one file);
            an ``s3://`` or other fsspec URL of a file, prefix (folder) or glob.
        endpoint_url: S3-compatible endpoint for ``s3://`` sources (`detpipe.files.fsspec_filesystem`).
    Returns:
        the files (may include non-images: they are skipped, counted, when decoded).
    Raises:
        StageError: ``source`` does not exist, the folder is empty or the glob matches no file (names the
            source, credentials and query redacted).
    """
    shown = redact_url(source)
    if is_url(source) and url_protocol(source) in ("http", "https"):
        name = posixpath.basename(source.split("?", 1)[0].rstrip("/")) or "image"
        return [SourceFile(name, source)]
    fs, path = fsspec_filesystem(source, endpoint_url=endpoint_url, label=shown)
    try:
        if any(c in path for c in _GLOB_CHARS):
            parts = path.split("/")
            root = "/".join(parts[:next(i for i, p in enumerate(parts) if any(c in p for c in _GLOB_CHARS))])
            found = [p for p, info in fs.glob(path, detail=True).items() if info.get("type") == "file"]
            what = "the glob matches no file"
        elif fs.isdir(path):
            root = path
            found = [info["name"] for info in fs.ls(path, detail=True) if info.get("type") == "file"]
            what = "the folder has no files"
        elif fs.isfile(path):
            root, found, what = posixpath.dirname(path), [path], ""
        else:
            raise StageError(f"{shown}: not found (SOURCE must be an image file, a folder, a glob or a URL)")
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - listing a remote store: permission, network, bad bucket
        raise StageError(f"{shown}: cannot list ({type(e).__name__}: {e})") from None
    if not found:
        raise StageError(f"{shown}: {what}: nothing to predict on")
    files = [SourceFile(posixpath.relpath(p, root) if root else p, p, fs) for p in found]
    return sorted(files, key=lambda f: f.file_name)


def preprocess_config(cache_meta: dict, where: str = "data/cache/meta.json") -> params_mod.Augment:
    """The augment stage's resize and encoding settings recorded in the cache's ``meta.json``
    (`detpipe.data.augment.build_cache` writes them), as an ``augment`` params section for `prepare`.
    Raises `StageError` naming ``where`` when a setting is missing or invalid."""
    missing = [k for k in PREPROCESS_KEYS[:-1] if k not in cache_meta]
    if missing:
        raise StageError(f"{where}: no {', '.join(missing)} (made by an older augment stage: re-run it)")
    try:
        return params_mod.Augment(**{k: cache_meta[k] for k in PREPROCESS_KEYS if cache_meta.get(k) is not None})
    except ValueError as e:
        raise StageError(f"{where}: invalid preprocessing settings ({' '.join(str(e).split())})") from None


def data_meta(data_dir: Path) -> tuple[dict, params_mod.Augment]:
    """The data facts predict needs from the run that trained the model: ``data_dir/arrow/meta.json`` (the
    convert stage's: ``category_id_to_label``, ``label_names``, ``num_classes``) and the preprocessing of
    ``data_dir/cache/meta.json`` (the augment stage's, `preprocess_config`).
    Raises `StageError` naming the missing or invalid file and what it is needed for."""
    metas = []
    for rel, stage, why in (("arrow/meta.json", "convert", "the dataset's category ids and names"),
                            ("cache/meta.json", "augment", "the resize rule the model was trained with")):
        path = data_dir / rel
        if not path.is_file():
            raise StageError(f"{path}: not found; predict reads {why} from it (the {stage} stage writes it: run "
                             "`dvc repro`, or pass --data DIR of the run that trained the model)")
        metas.append(read_meta(path))
    missing = [k for k in ("category_id_to_label", "label_names", "num_classes") if k not in metas[0]]
    if missing:
        raise StageError(f"{data_dir / 'arrow/meta.json'}: no {', '.join(missing)} (re-run the convert stage)")
    return metas[0], preprocess_config(metas[1], str(data_dir / "cache/meta.json"))


def prepare(data: bytes, name: str, cfg: params_mod.Augment) -> Prepared:
    """Decode one encoded image and prepare it as the augment stage prepared training and val images:
    `detpipe.data.imageio.decode_rgb`, resize to `detpipe.data.augmentation.target_size` (bilinear, antialias:
    `detpipe.data.augmentation.resize_pixels`), with ``cfg.encoding == "jpeg"`` the cache's JPEG round trip
    (`detpipe.data.augmentation.encode_pixels` at ``cfg.jpeg_quality``, decoded by
    `detpipe.data.dataset.decode_images` as the loader does), then ``/ 255`` to float32.

    Args:
        data: the file's bytes.
        name: the file's name, for errors.
        cfg: the preprocessing settings (`preprocess_config`).
    Returns:
        `Prepared` (shapes and units there).
    Raises:
        StageError: the bytes are not a readable image (names ``name``).
    """
    pixels = decode_rgb(data, name)
    oh, ow = pixels.shape[:2]
    h, w = target_size(oh, ow, cfg)
    chw = resize_pixels(pixels, (h, w))
    if cfg.encoding == "jpeg":
        u8 = decode_images([torch.frombuffer(bytearray(encode_pixels(chw, cfg)), dtype=torch.uint8)])[0]
    else:
        u8 = torch.from_numpy(chw)
    image = u8.to(torch.float32, memory_format=torch.contiguous_format).mul_(1.0 / 255)  # as the loader does
    return Prepared(image, torch.from_numpy(pixels).permute(2, 0, 1), (h / oh, w / ow))


Runner = Callable[[list[torch.Tensor]], list[dict]]


def load_runner(model_path: Path | str) -> tuple[Runner, str, int | None]:
    """A function running the model file on a batch of prepared images, a description of the runtime, and the
    number of classes (background included) the model was built for (None for ONNX: not recorded in the file).

    The runner takes ``float32 (3, h, w)`` images in [0, 1] and returns per image ``{"boxes": float32 (N, 4)
    XYXY prepared-image pixels, "scores": float32 (N,), "labels": int64 (N,)}``.

    Args:
        model_path: ``*.onnx`` (onnxruntime, ``CPUExecutionProvider``, one image per call) or ``*.pt`` (the
            train stage's checkpoint, `detpipe.models.load_model`, eager, the batch at once, CPU).
    Raises:
        StageError: the file is missing, of an unknown kind, or not loadable.
    """
    path = Path(model_path)
    if not path.is_file():
        raise StageError(f"{path}: model not found (run the pipeline, `dvc repro`, or pass --model "
                         "models/model.onnx or models/model.pt)")
    if path.suffix == ".onnx":
        import onnxruntime as ort

        try:
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own error types for bad files
            raise StageError(f"{path}: not a loadable ONNX model ({type(e).__name__}: {e})") from None
        names = [o.name for o in session.get_outputs()][:3]
        if names != ["boxes", "scores", "labels"]:
            raise StageError(f"{path}: outputs {names} are not the export stage's (boxes, scores, labels)")

        def run_onnx(images: list[torch.Tensor]) -> list[dict]:
            outs = [session.run(names, {"image": im.numpy()}) for im in images]
            return [{"boxes": torch.from_numpy(b), "scores": torch.from_numpy(s), "labels": torch.from_numpy(lab)}
                    for b, s, lab in outs]
        return run_onnx, f"onnxruntime {ort.__version__} ({path})", None
    if path.suffix == ".pt":
        from detpipe.models import load_model

        try:
            model, ckpt = load_model(path)
        except StageError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.load / load_state_dict on a foreign file
            raise StageError(f"{path}: not the train stage's model file ({type(e).__name__}: {e})") from None

        @torch.inference_mode()
        def run_eager(images: list[torch.Tensor]) -> list[dict]:
            return [{k: out[k] for k in ("boxes", "scores", "labels")} for out in model(images)]
        return run_eager, f"torch {torch.__version__} eager ({path})", int(ckpt["config"]["num_classes"])
    raise StageError(f"{path}: unknown model file type (expected .onnx or .pt)")


def to_original(boxes: torch.Tensor, scale: tuple[float, float], orig_size: tuple[int, int]) -> torch.Tensor:
    """Boxes ``float32 (N, 4)`` XYXY in prepared pixels -> original-image pixels: ``orig = prepared / scale``
    per axis (the cache's rule, offset 0), clipped to ``[0, W] x [0, H]``. ``scale``: ``(scale_y, scale_x)``,
    ``orig_size``: ``(H, W)``."""
    (sy, sx), (oh, ow) = scale, orig_size
    out = boxes.double() / torch.tensor([sx, sy, sx, sy], dtype=torch.float64)
    return torch.stack([out[:, 0].clamp(0, ow), out[:, 1].clamp(0, oh), out[:, 2].clamp(0, ow),
                        out[:, 3].clamp(0, oh)], dim=1)


def coco_results(det: dict, prep: Prepared, image_id: int, file_name: str, label_to_cat: dict[int, int],
                 label_names: list[str], score_threshold: float) -> list[dict]:
    """One image's detections (a runner's dict) as COCO result dicts (see the module docstring), boxes in
    original pixels (`to_original`), those with ``score >= score_threshold``, highest score first.
    Raises `StageError` for a label the data meta does not know (model and data from different runs)."""
    boxes = to_original(det["boxes"].reshape(-1, 4), prep.scale, prep.orig_size)
    scores, labels = det["scores"].reshape(-1), det["labels"].reshape(-1)
    out = []
    for k in torch.argsort(scores, descending=True, stable=True).tolist():
        score, label = float(scores[k]), int(labels[k])
        if score < score_threshold:
            continue
        if label not in label_to_cat:
            raise StageError(f"{file_name}: the model predicts label {label}, the data meta knows labels "
                             f"{min(label_to_cat)}..{max(label_to_cat)}: model and data come from different runs")
        x1, y1, x2, y2 = (float(v) for v in boxes[k])
        out.append({"image_id": image_id, "file_name": file_name, "category_id": label_to_cat[label],
                    "category_name": label_names[label], "bbox": [x1, y1, x2 - x1, y2 - y1], "score": score})
    return out


def draw(prep: Prepared, results: list[dict]) -> bytes:
    """The original image with ``results``' boxes (original pixels) and ``category_name score`` labels drawn
    (``torchvision.utils.draw_bounding_boxes``, red, line width scaled with the image), as JPEG bytes
    (quality 90)."""
    from torchvision.io import encode_jpeg
    from torchvision.utils import draw_bounding_boxes

    image = prep.pixels
    if results:
        xyxy = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (r["bbox"] for r in results)])
        width = max(2, round(max(prep.orig_size) / 320))
        image = draw_bounding_boxes(image, xyxy, labels=[f"{r['category_name']} {r['score']:.2f}" for r in results],
                                    colors="red", width=width)
    return encode_jpeg(image.contiguous(), quality=90).numpy().tobytes()


def _load(item: tuple[int, SourceFile], cfg: params_mod.Augment) -> tuple[int, SourceFile, Prepared | str]:
    """Read and prepare one file in a worker thread: ``(image id, file, Prepared or the reason it is skipped)``."""
    image_id, f = item
    try:
        return image_id, f, prepare(f.read(), f.file_name, cfg)
    except StageError as e:
        return image_id, f, str(e)
    except Exception as e:  # noqa: BLE001 - untrusted files: any reader or decoder failure is a counted skip
        return image_id, f, f"{f.file_name}: cannot read ({type(e).__name__}: {e})"


def predict(source: str, model_path: Path | str = DEFAULT_MODEL, out_dir: Path | str = DEFAULT_OUT,
            score_threshold: float = SCORE_THRESHOLD, batch_size: int = BATCH_SIZE, data_dir: Path | str = DEFAULT_DATA,
            draw_images: bool = True, endpoint_url: str | None = None, workers: int | None = None) -> dict:
    """Run ``model_path`` on every file of ``source`` and write ``predictions.json``, ``images/`` and
    ``report.json`` into ``out_dir`` (see the module docstring for their content); return the report.

    Args:
        source: see `list_sources`.
        model_path: ``models/model.onnx`` or ``models/model.pt`` (`load_runner`).
        out_dir: output folder (created; the three outputs in it are replaced, nothing else is touched).
        score_threshold: detections with a lower score are not written nor drawn (scores are in [0, 1]).
        batch_size: images decoded and run together (>= 1).
        data_dir: the pipeline's data folder: ``arrow/meta.json`` (category ids and names, the convert stage's)
            and ``cache/meta.json`` (resize and encoding, the augment stage's).
        draw_images: write ``images/`` (False: only the JSON files; ``images/`` is left as it was).
        endpoint_url: S3-compatible endpoint for ``s3://`` sources.
        workers: threads reading and decoding files (default: CPU cores, at most 4).
    Returns:
        ``report.json``'s dict: ``num_images``, ``num_detections``, ``num_skipped``, ``skipped`` (``[{"file_name",
        "reason"}]``), ``images`` (COCO images list), ``source``, ``model``, ``runtime``, ``score_threshold``,
        ``batch_size``, ``seconds`` (wall time of reading, inference and writing), ``images_per_s``.
    Raises:
        StageError: bad arguments, a missing model or data meta file, a source with no files, or no file of
        the source could be read (each names the file or source and the rule).
    """
    if batch_size < 1:
        raise StageError(f"--batch-size {batch_size}: must be at least 1")
    if not 0.0 <= score_threshold <= 1.0:
        raise StageError(f"--score-threshold {score_threshold}: must be in [0, 1] (scores are probabilities)")
    run, runtime, model_classes = load_runner(model_path)
    arrow_meta, cfg = data_meta(Path(data_dir))
    label_to_cat, label_names = label_to_category_id(arrow_meta), arrow_meta["label_names"]
    if model_classes is not None and model_classes != arrow_meta["num_classes"]:
        raise StageError(f"{model_path}: model built for {model_classes} classes, {data_dir}/arrow/meta.json has "
                         f"{arrow_meta['num_classes']}: model and data come from different runs")
    files = list_sources(source, endpoint_url)
    log.info("predict: %d files from %s with %s, batches of %d", len(files), redact_url(source), runtime, batch_size)

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    images: list[dict] = []
    skipped: list[dict] = []
    used: set[str] = set()

    def finish(batch: list[tuple[int, SourceFile, Prepared]], drawn: Path | None) -> None:
        """Run one batch, collect its results and images, draw them into ``drawn``."""
        for (image_id, f, prep), det in zip(batch, run([p.image for _, _, p in batch])):
            found = coco_results(det, prep, image_id, f.file_name, label_to_cat, label_names, score_threshold)
            results.extend(found)
            images.append({"id": image_id, "file_name": f.file_name, "width": prep.orig_size[1],
                           "height": prep.orig_size[0]})
            if drawn is not None:
                name = Path(f.file_name).with_suffix(".jpg").as_posix()
                if name in used:  # a.png beside a.jpg
                    name = Path(f.file_name).with_suffix(f".{image_id}.jpg").as_posix()
                used.add(name)
                (drawn / name).parent.mkdir(parents=True, exist_ok=True)
                (drawn / name).write_bytes(draw(prep, found))

    progress = Progress(len(files), "predict", unit="image")
    workers = workers or min(4, os.cpu_count() or 1)
    drawing = atomic_dir(out_dir / "images") if draw_images else contextlib.nullcontext(None)
    with cf.ThreadPoolExecutor(workers) as pool, drawing as drawn:
        loaded = bounded_map(pool, lambda item: _load(item, cfg), enumerate(files, start=1), window=2 * batch_size)
        batch: list[tuple[int, SourceFile, Prepared]] = []
        for n, (image_id, f, prep) in enumerate(loaded, start=1):
            if isinstance(prep, str):
                skipped.append({"file_name": f.file_name, "reason": prep})
                log.warning("skipped %s", prep)
                progress.update(1)
            else:
                batch.append((image_id, f, prep))
            if batch and (len(batch) == batch_size or n == len(files)):
                finish(batch, drawn)
                progress.update(len(batch), images=len(batch))
                batch = []
        progress.close()
        if not images:
            raise StageError(f"{redact_url(source)}: none of its {len(files)} files could be read as an image "
                             f"(first: {skipped[0]['reason']})")
    seconds = time.perf_counter() - t0
    report = {"source": redact_url(source), "model": str(model_path), "runtime": runtime,
              "score_threshold": score_threshold, "batch_size": batch_size, "num_images": len(images),
              "num_detections": len(results), "num_skipped": len(skipped), "skipped": skipped, "images": images,
              "seconds": seconds, "images_per_s": len(images) / seconds}
    atomic_write_json(out_dir / "predictions.json", results)
    atomic_write_json(out_dir / "report.json", report)
    log.info("predict: %d images, %d detections with score >= %g, %d skipped%s; %.1f s, %.2f images/s; wrote %s",
             len(images), len(results), score_threshold, len(skipped),
             f" ({', '.join(s['file_name'] for s in skipped)})" if skipped else "", seconds, len(images) / seconds,
             out_dir)
    return report


def main(argv: list[str] | None = None) -> None:
    """``python -m detpipe.predict``: parse the command line (``--help``) and run `predict`."""
    parser = argparse.ArgumentParser(
        prog="python -m detpipe.predict",
        description="Run the exported (ONNX, default) or trained (model.pt) detector on images; write COCO "
                    "results JSON (original-image pixels, the dataset's category ids) and drawn images.")
    parser.add_argument("source", metavar="SOURCE",
                        help="image file, folder, glob (quoted), http(s):// URL of an image, or s3:// file/prefix/glob")
    parser.add_argument("--model", default=str(DEFAULT_MODEL),
                        help=f"models/model.onnx (onnxruntime) or models/model.pt (eager PyTorch); default {DEFAULT_MODEL}")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help=f"output folder: predictions.json, report.json, images/ (default {DEFAULT_OUT})")
    parser.add_argument("--score-threshold", type=float, default=SCORE_THRESHOLD,
                        help=f"keep detections with at least this score, in [0, 1] (default {SCORE_THRESHOLD})")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                        help=f"images decoded and run together (default {BATCH_SIZE})")
    parser.add_argument("--data", default=str(DEFAULT_DATA),
                        help="the pipeline's data folder with arrow/meta.json (category ids and names) and "
                             f"cache/meta.json (resize rule) (default {DEFAULT_DATA})")
    parser.add_argument("--no-draw", action="store_true", help="do not write images/ (JSON only)")
    parser.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint for s3:// sources")
    args = parser.parse_args(argv)
    predict(args.source, args.model, args.out, args.score_threshold, args.batch_size, args.data,
            draw_images=not args.no_draw, endpoint_url=args.endpoint_url)


if __name__ == "__main__":
    run_program(main, stage="predict")
