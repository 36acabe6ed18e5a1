"""The serve command's models: a loaded, warmed-up model (`Served`), its version (`model_version`) and the copy of
a DVC experiment's exported model that ``exp:<name>`` reloads (`fetch_experiment_model`)."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path

from detpipe.core.errors import StageError
from detpipe.predict import Predictor


def model_version(path: Path) -> str:
    """The first 12 hex digits of the sha256 of the model file ``path`` (and, for an OpenVINO ``.xml``, of its
    ``.bin`` after it): what ``/readyz``, the reload's answer and ``detpipe_serve_model_info`` call its version."""
    digest = hashlib.sha256()
    for f in (path, path.with_suffix(".bin")) if path.suffix == ".xml" else (path,):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class Served:
    """A loaded, warmed-up model: its `detpipe.predict.Predictor`, the source it was named by (a path or
    ``exp:<name>``), the file loaded, its version (`model_version`) and when it was loaded (Unix seconds)."""

    predictor: Predictor
    source: str
    path: str
    version: str
    loaded_at: float


EXP_MODEL = "models/model.onnx"   # what ``exp:<name>`` reloads: the export stage's file of that experiment


def fetch_experiment_model(name: str, dest_dir: Path, repo: str | None = None) -> Path:
    """``models/model.onnx`` of DVC experiment, branch or tag ``name`` (``dvc.api.open``: the DVC cache or the
    default remote; the repository of the current folder unless ``repo``), copied into ``dest_dir`` (written to a
    temporary name, then renamed). Returns the copy's path.

    Raises:
        StageError: no name, an unknown revision, or a revision without the file (one line).
    """
    import dvc.api
    from dvc.exceptions import DvcException, PathMissingError
    from scmrepo.exceptions import SCMError

    if not name:
        raise StageError("'exp:' needs an experiment, branch or tag name")
    try:
        with dvc.api.open(EXP_MODEL, repo=repo, rev=name, mode="rb") as f:
            data = f.read()
    except (FileNotFoundError, PathMissingError):
        raise StageError(f"exp:{name}: the revision has no {EXP_MODEL} (neither tracked by DVC nor by git, or not in "
                         "the DVC cache nor on the remote)") from None
    except (DvcException, SCMError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StageError(f"exp:{name}: cannot read {EXP_MODEL}: {first}") from None
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{hashlib.sha256(data).hexdigest()[:12]}.onnx"
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dest)
    return dest

