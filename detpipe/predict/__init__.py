"""Run the exported or the trained detector on images: ``python -m detpipe.predict SOURCE [options]``.

``SOURCE`` is one image file, a folder (the files directly in it), a glob (``"photos/*.jpg"``,
``"data/**/*.png"``: quote it), an ``http(s)://`` URL of one image, or an ``s3://`` (or any fsspec) URL of a
file, a prefix (folder) or a glob. Every listed file is read and decoded with the pipeline's own decoder
(`detpipe.data.imageio.decode_rgb`: EXIF orientation applied, 16-bit / float / palette / CMYK / alpha images
to 8-bit RGB), then prepared exactly as the augment stage prepared the training and val images
(`prepare`: the resize rule of ``data/cache/meta.json``, bilinear with antialias, and the JPEG round trip
of a ``jpeg`` cache), so the model sees what it was trained and evaluated on.

The model is ``models/model.onnx`` (default; run with onnxruntime on the CPU, the file the export stage
wrote and parity-checked), any other file the export stage wrote with ``export.formats`` (chosen by the file:
``models/int8/model.int8.onnx``, int8 QDQ, onnxruntime; ``models/openvino/model.xml``, OpenVINO IR, OpenVINO's CPU
runtime at float32) or ``models/model.pt`` (``--model models/model.pt``: the trained eager PyTorch model,
batched); `detpipe.predict.runners.load_runner`. Every format gives the same outputs. Boxes come back in the prepared image's pixels and are mapped to the original image's pixels
with the cache's rule ``orig = prepared / scale`` and turned into COCO results by
`detpipe.evaluation.detections.image_detections` (the evaluate stage's own mapping), labels to the dataset's COCO
category ids and names with ``data/arrow/meta.json``; boxes are drawn by `detpipe.vis.drawing`.

Writes into ``--out`` (default ``predictions/``):

* ``predictions.json``: COCO results (a JSON list, as ``COCO.loadRes`` takes), one dict per detection with
  score >= ``--score-threshold``: ``image_id`` (int, 1.. in the sorted order of the listed files),
  ``file_name`` (path relative to the source folder), ``category_id`` (the dataset's id), ``category_name``,
  ``bbox`` ``[x, y, w, h]`` (float, original-image pixels, clipped to the image), ``score`` (float in [0, 1]);
* ``images/<file stem>.jpg``: each image at its original size with its boxes and ``name score`` drawn;
* ``report.json``: counts, the skipped files with the reason, the images (``id``, ``file_name``, ``width``,
  ``height``: a COCO ``images`` list), the runtime, seconds and images/s.

Each output is replaced atomically (`detpipe.core.files.atomic_dir`, `detpipe.core.files.atomic_write_json`): an
interrupted run leaves the previous outputs as they were. A file that cannot be read or decoded (corrupt, not an
image) is skipped, counted and named in the log and in ``report.json``; a missing model, missing data meta files
or a source with no files is a one-line error (exit status 2).

Batches: ``--batch-size`` images are decoded (in threads) and run together; the eager model takes them as one
batch, the ONNX, int8 and OpenVINO files (one ``(3, H, W)`` image per call:
`detpipe.export.exporter.DetectionExport`'s signature) one after the other.

The package: `predict` here (the run and its outputs; `load_predictor`, the model with its data facts, which
`detpipe.serve` shares), `detpipe.predict.sources` (`list_sources`),
`detpipe.predict.preprocess` (`data_meta`, `prepare`), `detpipe.predict.runners` (`load_runner`),
``__main__`` (the command line).
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

from detpipe import params as params_mod
from detpipe.core.errors import StageError
from detpipe.evaluation.detections import image_detections, label_to_category_id
from detpipe.vis.drawing import draw_boxes, line_width
from detpipe.core.files import atomic_dir, atomic_write_json, redact_url
from detpipe.core.pool import bounded_map
from detpipe.predict.preprocess import PREPROCESS_KEYS, Prepared, data_meta, prepare, preprocess_config
from detpipe.predict.runners import Runner, load_runner
from detpipe.predict.sources import SourceFile, list_sources
from detpipe.core.progress import Progress

__all__ = ["BATCH_SIZE", "DEFAULT_DATA", "DEFAULT_MODEL", "DEFAULT_OUT", "PREPROCESS_KEYS", "SCORE_THRESHOLD",
           "Predictor", "Prepared", "Runner", "SourceFile", "data_meta", "list_sources", "load_predictor",
           "load_runner", "predict", "prepare", "preprocess_config"]

log = logging.getLogger("detpipe.predict")

DEFAULT_MODEL = Path("models/model.onnx")
DEFAULT_DATA = Path("data")
DEFAULT_OUT = Path("predictions")
SCORE_THRESHOLD = 0.25  # default --score-threshold (Ultralytics' ``conf`` default)
BATCH_SIZE = 8


@dataclasses.dataclass
class Predictor:
    """A loaded model file with the data facts of the run that trained it: what `predict` runs, and
    `detpipe.serve` (`load_predictor` makes one).

    ``run``: `load_runner`'s runner (``float32 (3, h, w)`` prepared images in [0, 1] -> per image ``boxes``
    ``float32 (N, 4)`` XYXY prepared pixels, ``scores`` ``(N,)``, ``labels`` ``int64 (N,)``); ``runtime``: its
    description; ``cfg``: the preprocessing (`prepare`'s settings, from ``data/cache/meta.json``);
    ``label_to_category``: training label -> the dataset's COCO category id; ``label_names``: label -> category name.
    """

    run: Runner
    runtime: str
    cfg: params_mod.Augment
    label_to_category: dict[int, int]
    label_names: list[str]

    def results(self, det: dict, prep: Prepared | tuple[tuple[float, float], tuple[int, int]], image_id: int,
                file_name: str, score_threshold: float = SCORE_THRESHOLD) -> list[dict]:
        """One image's model output ``det`` as predict's COCO results (``predictions.json``'s dicts for the image:
        ``bbox`` ``[x, y, w, h]`` in original-image pixels, the dataset's ``category_id`` and ``category_name``,
        ``score >= score_threshold``, highest first; `detpipe.evaluation.detections.image_detections`).

        Args:
            det: the runner's output for the image.
            prep: the image's `Prepared`, or its ``(scale, orig_size)``: ``(scale_y, scale_x)`` prepared pixels per
                original pixel and ``(H, W)`` original pixels.
            image_id, file_name: written into each dict.
            score_threshold: in [0, 1].
        Raises:
            StageError: the model predicts a label the data meta does not know (model and data from different runs).
        """
        scale, orig_size = (prep.scale, prep.orig_size) if isinstance(prep, Prepared) else prep
        return image_detections(det, image_id, self.label_to_category, scale, orig_size,
                                score_threshold=score_threshold, file_name=file_name, label_names=self.label_names)

    def predict_bytes(self, data: bytes, file_name: str = "image", image_id: int = 1,
                      score_threshold: float = SCORE_THRESHOLD) -> list[dict]:
        """One encoded image's COCO results, as `predict` writes them for that image alone (`prepare`, the model,
        `results`).

        Raises:
            StageError: the bytes are not a readable image (names ``file_name``), or as `results`.
        """
        prep = prepare(data, file_name, self.cfg)
        return self.results(self.run([prep.image])[0], prep, image_id, file_name, score_threshold)


def load_predictor(model_path: Path | str = DEFAULT_MODEL, data_dir: Path | str = DEFAULT_DATA) -> Predictor:
    """Load ``model_path`` (`load_runner`) and the data facts of ``data_dir`` (`data_meta`: ``arrow/meta.json``'s
    category ids and names, ``cache/meta.json``'s preprocessing) into a `Predictor`.

    Raises:
        StageError: a missing or unloadable model, missing or invalid data meta files, or a model built for another
            number of classes than ``arrow/meta.json`` has (model and data from different runs).
    """
    run, runtime, model_classes = load_runner(model_path)
    arrow_meta, cfg = data_meta(Path(data_dir))
    if model_classes is not None and model_classes != arrow_meta["num_classes"]:
        raise StageError(f"{model_path}: model built for {model_classes} classes, {data_dir}/arrow/meta.json has "
                         f"{arrow_meta['num_classes']}: model and data come from different runs")
    return Predictor(run, runtime, cfg, label_to_category_id(arrow_meta), arrow_meta["label_names"])


def _drawn(prep: Prepared, results: list[dict]) -> bytes:
    """The original image with ``results``' boxes (original pixels) and ``category_name score`` labels drawn
    (`detpipe.vis.drawing.draw_boxes`, red, `detpipe.vis.drawing.line_width`), as JPEG bytes
    (quality 90)."""
    from torchvision.io import encode_jpeg

    image = draw_boxes(prep.pixels, [r["bbox"] for r in results], "red", line_width(prep.orig_size),
                       labels=[f"{r['category_name']} {r['score']:.2f}" for r in results])
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
        model_path: ``models/model.onnx``, ``models/int8/model.int8.onnx``, ``models/openvino/model.xml`` or
            ``models/model.pt`` (`load_runner`).
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
    model = load_predictor(model_path, data_dir)
    run, runtime, cfg = model.run, model.runtime, model.cfg
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
            found = model.results(det, prep, image_id, f.file_name, score_threshold)
            results.extend(found)
            images.append({"id": image_id, "file_name": f.file_name, "width": prep.orig_size[1],
                           "height": prep.orig_size[0]})
            if drawn is not None:
                name = Path(f.file_name).with_suffix(".jpg").as_posix()
                if name in used:  # a.png beside a.jpg
                    name = Path(f.file_name).with_suffix(f".{image_id}.jpg").as_posix()
                used.add(name)
                (drawn / name).parent.mkdir(parents=True, exist_ok=True)
                (drawn / name).write_bytes(_drawn(prep, found))

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
