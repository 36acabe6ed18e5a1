"""Warm starts of the train stage: ``train.weights`` naming the model of another DVC experiment, branch or tag
(``exp:<name>``) or a checkpoint of this repository (``checkpoint:best``, ``checkpoint:last``), resolved by the
launcher before any worker starts and copied to ``checkpoints/warm_start.pt`` (`materialise_weights`), which the
workers load with `detpipe.models.load_weights`. Its own module, apart from `detpipe.models`, so that the evaluate and
export stages (which build models) do not depend on DVC's API or on the checkpoint code. docs/train.md, "Starting
from another experiment or a checkpoint".
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from detpipe.core.errors import StageError
from detpipe.core.paths import MODEL, list_checkpoints

log = logging.getLogger(__name__)


WARM_START_PREFIXES = ("exp:", "checkpoint:")
"""``train.weights`` values that name a model of a DVC revision or a checkpoint of this repository."""


def is_warm_start(source: str | None) -> bool:
    """True for ``exp:<name>``, ``checkpoint:best``, ``checkpoint:last`` (`materialise_weights`)."""
    return bool(source) and source.startswith(WARM_START_PREFIXES)


def _read_revision_model(name: str, repo: str | None) -> bytes:
    import dvc.api
    from dvc.exceptions import DvcException
    from scmrepo.exceptions import SCMError

    try:
        with dvc.api.open(str(MODEL), repo=repo, rev=name, mode="rb") as f:
            return f.read()
    except FileNotFoundError:
        raise StageError(f"params.yaml: key 'train.weights': revision '{name}' has no {MODEL} "
                         f"(neither in the DVC cache nor on the remote)") from None
    except (DvcException, SCMError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StageError(f"params.yaml: key 'train.weights': cannot read {MODEL} of experiment, branch or tag "
                         f"'{name}': {first}") from None


def warm_start_path(ckpt_dir: Path | str) -> Path:
    """Where `materialise_weights` copies ``exp:``/``checkpoint:`` weights: ``<ckpt_dir>/warm_start.pt``."""
    return Path(ckpt_dir) / "warm_start.pt"


def materialise_weights(source: str, sha256: str | None, dest: Path, ckpt_dir: Path, repo: str | None = None) -> Path:
    """Copy the weights ``source`` names to ``dest`` (atomically) and return ``dest``.

    ``exp:<name>``: ``models/model.pt`` of DVC experiment, branch or tag ``<name>`` read with ``dvc.api.open``
    (DVC cache or default remote); its sha256 must equal ``sha256`` (``train.weights_sha256``), which is
    required: the pin that dvc.lock records (the train stage's params), so a changed experiment fails instead of
    being used silently. ``checkpoint:best``: ``ckpt_dir/best.pt``; ``checkpoint:last``: the newest
    ``ckpt_dir/ckpt-*.pt`` (checked against ``sha256`` when given). The copy is made before any worker starts
    (the launcher, `detpipe.launch.jobs.check_inputs`), so a fresh start deleting the checkpoints does not lose it.

    Raises:
        StageError: one line naming ``train.weights`` and the problem (unknown revision, no model.pt, no best.pt,
            no checkpoint, bad value, sha256 missing or different).
    """
    key = "params.yaml: key 'train.weights'"
    if source.startswith("exp:"):
        name = source[len("exp:"):]
        if not name:
            raise StageError(f"{key}: 'exp:' needs an experiment, branch or tag name")
        data = _read_revision_model(name, repo)
        if sha256 is None:
            actual = hashlib.sha256(data).hexdigest()
            raise StageError(f"{key}: '{source}' needs train.weights_sha256 (the pin dvc.lock records); "
                             f"its {MODEL} has sha256 {actual}")
    elif source == "checkpoint:best":
        path = Path(ckpt_dir) / "best.pt"
        if not path.is_file():
            raise StageError(f"{key}: 'checkpoint:best' but {path} does not exist "
                             f"(set train.eval_every and train first)")
        data = path.read_bytes()
    elif source == "checkpoint:last":
        ckpts = list_checkpoints(ckpt_dir)
        if not ckpts:
            raise StageError(f"{key}: 'checkpoint:last' but {ckpt_dir} holds no ckpt-*.pt")
        data = ckpts[-1].read_bytes()
    else:
        raise StageError(f"{key}: '{source}': expected exp:<name>, checkpoint:best or checkpoint:last")
    actual = hashlib.sha256(data).hexdigest()
    if sha256 is not None and actual != sha256:
        raise StageError(f"{key}: '{source}' has sha256 {actual}, train.weights_sha256 says {sha256}")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, dest)
    log.info("train.weights %s (sha256 %s) copied to %s", source, actual, dest)
    return dest
