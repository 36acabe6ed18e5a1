"""Checkpoint files: ``ckpt-NNNNNNN.pt`` naming, atomic ``torch.save``, RNG state, and which one to resume from."""
from __future__ import annotations

import logging
import random
import re
from pathlib import Path

import numpy as np
import torch

from detpipe.errors import StageError
from detpipe.files import atomic_open

log = logging.getLogger("detpipe.engine.checkpoints")

FORMAT = 2  # 2: the trainer's EventStorage holds the metric rows (1: MetricsHook did)
_CKPT_RE = re.compile(r"^ckpt-(\d{7})\.pt$")


def checkpoint_path(directory: Path | str, done: int) -> Path:
    """``<directory>/ckpt-NNNNNNN.pt`` for ``done`` completed iterations (7 digits, zero-padded)."""
    return Path(directory) / f"ckpt-{done:07d}.pt"


def list_checkpoints(directory: Path | str) -> list[Path]:
    """Checkpoint files ``ckpt-NNNNNNN.pt`` in ``directory``, oldest iteration first ([] if no directory)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _CKPT_RE.match(p.name)),
                  key=lambda p: int(_CKPT_RE.match(p.name).group(1)))


def save_atomic(obj, path: Path | str) -> None:
    """``torch.save(obj)`` to ``path`` atomically (`detpipe.files.atomic_open`: temporary file, fsync, rename)."""
    with atomic_open(path) as f:
        torch.save(obj, f)


def rng_state() -> dict:
    """This process's RNG states (Python, NumPy, torch CPU, CUDA) as tensors and plain types, so that
    ``torch.load(weights_only=True)`` reads them back."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of `rng_state`."""
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find_resume_state(resume: str, fingerprint: str, ckpt_dir: Path | str) -> dict | None:
    """The newest readable checkpoint in ``ckpt_dir`` of this `FORMAT` made with ``fingerprint``, per
    ``train.resume`` (``auto``, ``never``, ``must``).

    Temporary files of a save interrupted by a kill are removed first. Returns the loaded checkpoint dict, or
    None to start fresh (checkpoints of other params are then deleted, and the reason logged).
    Raises:
        StageError: ``resume == "must"`` and no matching checkpoint.
    """
    ckpt_dir = Path(ckpt_dir)
    for stale in ckpt_dir.glob(".ckpt-*.tmp-*"):
        stale.unlink(missing_ok=True)
    ckpts = list_checkpoints(ckpt_dir)
    if resume == "never":
        reason = "train.resume is 'never'"
    elif not ckpts:
        reason = f"no checkpoint in {ckpt_dir}/"
    else:
        for path in reversed(ckpts):
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # truncated or foreign file: try the previous one
                log.warning("%s: unreadable checkpoint (%s), trying an older one", path, e)
                continue
            if state.get("fingerprint") == fingerprint and state.get("format") == FORMAT:
                log.info("resuming from %s (iteration %d)", path, state["iter"])
                return state
            reason = (f"{path} was made with other training params or data (fingerprint "
                      f"{str(state.get('fingerprint'))[:12]} != {fingerprint[:12]})"
                      if state.get("fingerprint") != fingerprint else
                      f"{path} has checkpoint format {state.get('format')}, this trainer writes {FORMAT}")
            break
        else:
            reason = f"no readable checkpoint in {ckpt_dir}/"
    if resume == "must":
        raise StageError(f"train.resume is 'must' but there is nothing to resume: {reason}")
    if ckpts:
        log.info("starting fresh: %s; removing %d old checkpoint(s)", reason, len(ckpts))
        for p in ckpts:
            p.unlink(missing_ok=True)
    else:
        log.info("starting fresh: %s", reason)
    return None
