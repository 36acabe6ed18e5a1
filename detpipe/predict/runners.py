"""Running predict's model file, chosen by its name: ONNX float or int8 (onnxruntime), OpenVINO IR (OpenVINO's CPU
runtime) or the train stage's ``model.pt`` (eager): `load_runner`."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from detpipe.core.errors import StageError

Runner = Callable[[list[torch.Tensor]], list[dict]]


def load_runner(model_path: Path | str) -> tuple[Runner, str, int | None]:
    """A function running the model file on a batch of prepared images, a description of the runtime, and the
    number of classes (background included) the model was built for (None for ONNX and OpenVINO: not recorded in
    the file).

    The runner takes ``float32 (3, h, w)`` images in [0, 1] and returns per image ``{"boxes": float32 (N, 4)
    XYXY prepared-image pixels, "scores": float32 (N,), "labels": int64 (N,)}``. A runner that runs the images of
    a batch one after the other (ONNX and OpenVINO files of a one-image graph: families without a batched export,
    `detpipe.export.batched.BATCH_UNSUPPORTED`) has the attribute ``per_image = True``; a batched graph
    (`detpipe.export.batched`: SSD/SSDlite, RT-DETRv2, D-FINE) runs the whole batch in one call.

    Args:
        model_path: ``*.onnx`` (the export stage's ``models/model.onnx`` or its int8 ``models/int8/model.int8.onnx``:
            onnxruntime, ``CPUExecutionProvider``, intra-op threads that do not spin-wait), ``*.xml`` (OpenVINO IR,
            ``models/openvino/model.xml`` with its ``.bin`` beside it: OpenVINO's CPU plugin at float32 precision,
            `detpipe.export.formats.openvino_runner`) or ``*.pt`` (the train stage's checkpoint,
            `detpipe.models.load_model`, eager, the batch at once, CPU). All take and give the same tensors.
    Raises:
        StageError: the file is missing, of an unknown kind, or not loadable.
    """
    path = Path(model_path)
    if not path.is_file():
        raise StageError(f"{path}: model not found (run the pipeline, `dvc repro`, or pass --model "
                         "models/model.onnx, models/int8/model.int8.onnx, models/openvino/model.xml or models/model.pt)")
    if path.suffix == ".onnx":
        import onnxruntime as ort

        try:
            options = ort.SessionOptions()
            # intra-op threads sleep when idle instead of spin-waiting: the spinning burnt ~20 CPU ms per image of
            # SSDlite320 at one image per call (51 vs 29 CPU ms, 2 cores, loaded: benchmarks/serve_profile.py,
            # docs/measurements.md), cores the decoding threads of serve and predict need
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            if path.name.endswith(".int8.onnx"):
                from detpipe.export.formats import int8_session

                session = int8_session(path, options)
            else:
                session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own error types for bad files
            raise StageError(f"{path}: not a loadable ONNX model ({type(e).__name__}: {e})") from None
        names = [o.name for o in session.get_outputs()][:3]
        if names != ["boxes", "scores", "labels"]:
            raise StageError(f"{path}: outputs {names} are not the export stage's (boxes, scores, labels)")

        from detpipe.export.batched import BATCH_INDEX, graph_size, runner

        size = graph_size([(i.name, i.shape) for i in session.get_inputs()])
        wanted = [*names, BATCH_INDEX] if size is not None else names
        many = runner(lambda f: session.run(wanted, f), size).many

        def run_onnx(images: list[torch.Tensor]) -> list[dict]:
            return [{"boxes": torch.as_tensor(b), "scores": torch.as_tensor(s), "labels": torch.as_tensor(lab).long()}
                    for b, s, lab, *_ in many(images)]
        # a one-image graph: `detpipe.serve.batcher.Batcher` answers each image at once; a batched one: one call
        run_onnx.per_image = size is None
        run_onnx.session = session   # (its options: tests/unit/test_onnx_runner_threads.py)
        kind = "int8 QDQ" if path.name.endswith(".int8.onnx") else "float32"
        return run_onnx, f"onnxruntime {ort.__version__} {kind} ({path})", None
    if path.suffix == ".xml":
        import openvino as ov

        from detpipe.export.formats import openvino_runner

        if not path.with_suffix(".bin").is_file():
            raise StageError(f"{path}: its weights {path.with_suffix('.bin').name} are missing (an OpenVINO IR is "
                             "the .xml and the .bin beside it)")
        try:
            run_one = openvino_runner(path, ["boxes", "scores", "labels"])
        except StageError:
            raise StageError(f"{path}: outputs are not the export stage's (boxes, scores, labels)") from None
        except Exception as e:  # noqa: BLE001 - OpenVINO raises its own error types for bad files
            raise StageError(f"{path}: not a loadable OpenVINO IR ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None

        def run_openvino(images: list[torch.Tensor]) -> list[dict]:
            return [{"boxes": torch.as_tensor(b), "scores": torch.as_tensor(s), "labels": torch.as_tensor(lab).long()}
                    for b, s, lab, *_ in run_one.many(images)]
        run_openvino.per_image = not run_one.batched
        return run_openvino, f"openvino {ov.__version__} CPU float32 ({path})", None
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
    raise StageError(f"{path}: unknown model file type (expected .onnx, .xml (OpenVINO IR) or .pt)")
