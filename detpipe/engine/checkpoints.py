"""Checkpoint files: ``ckpt-NNNNNNN.pt`` naming, atomic ``torch.save``, RNG state, which training a checkpoint belongs
to (`fingerprint`) and which one to resume from. Imports torch but not torchvision: the launcher's `check_resume` runs
here without the model code."""
from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path

import numpy as np
import torch

from detpipe import params as params_mod
from detpipe.core.errors import StageError
from detpipe.core.model_file import save_torch_atomic
from detpipe.core.paths import ARROW_META, CACHE_DIR, CKPT_DIR
from detpipe.core.paths import checkpoint_path, list_checkpoints  # noqa: F401  (re-exported: the trainer's names)

log = logging.getLogger("detpipe.engine.checkpoints")

FORMAT = 3  # 3: the fingerprint leaves out the schedule keys, stored apart as "schedule" (2: it covered them; the trainer's EventStorage holds the metric rows; 1: MetricsHook did)
save_atomic = save_torch_atomic
"""Save a torch object to ``path`` atomically (`detpipe.core.model_file.save_torch_atomic`)."""


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


def remove_partial_saves(ckpt_dir: Path | str) -> None:
    """Delete the temporary files (``.ckpt-*.tmp-*``, `save_atomic`) of saves that never finished in ``ckpt_dir``:
    a kill -9 mid-save leaves one, and so can a SIGTERM that lands between the file's creation and the ``try``
    that removes it on error (`detpipe.core.files.atomic_open`'s ``mkstemp`` and its context manager's entry: a few
    bytecodes, seen once in ~10 full test runs). Call only where no save of this run is under way."""
    for stale in Path(ckpt_dir).glob(".ckpt-*.tmp-*"):
        stale.unlink(missing_ok=True)


def find_resume_state(resume: str, fingerprint: str, ckpt_dir: Path | str, schedule: dict | None = None) -> dict | None:
    """The checkpoint to resume or continue per `resume_decision`, or None to start fresh: then the checkpoints in
    ``ckpt_dir`` are deleted, and the reason logged. Temporary files of a save interrupted by a kill are removed
    first.

    Raises:
        StageError: as `resume_decision`.
    """
    ckpt_dir = Path(ckpt_dir)
    remove_partial_saves(ckpt_dir)
    state, message = resume_decision(resume, fingerprint, ckpt_dir, schedule)
    if state is not None:
        log.info("%s", message)
        return state
    ckpts = list_checkpoints(ckpt_dir)
    if ckpts:
        log.info("starting fresh: %s; removing %d old checkpoint(s)", message, len(ckpts))
        for p in ckpts:
            p.unlink(missing_ok=True)
    else:
        log.info("starting fresh: %s", message)
    return None


def resume_decision(resume: str, fingerprint: str, ckpt_dir: Path | str,
                    schedule: dict | None = None) -> tuple[dict | None, str]:
    """What ``train.resume`` makes of the checkpoints in ``ckpt_dir`` (nothing is changed there): the newest readable
    checkpoint of this `FORMAT` made with ``fingerprint`` (the same training: `fingerprint`)

    - resumes when its ``schedule`` (the schedule keys' values, `schedule_params`) equals
      ``schedule`` (``auto``, ``restart``, ``must``);
    - with another schedule and ``auto`` or ``must``, is *continued* when the new ``epochs`` leave iterations after
      it (after an early stop, only when ``patience`` or ``min_delta`` changed too); when it finished its own
      schedule (or stopped early) and the new one adds no epoch, it is another training (start fresh: the usual
      ``dvc exp run -S train.lr=...`` after a finished run); when it had not finished and the new ``epochs`` end
      before its iteration, StageError;
    - with another schedule and ``restart``: start fresh. ``never``: always start fresh.

    Returns:
        ``(checkpoint dict, "resuming from <path> (iteration N)" / "continuing from ...")``, or ``(None, why
        to start fresh)``.
    Raises:
        StageError: ``resume == "must"`` and nothing to resume or continue; an unfinished checkpoint whose training
        the new ``epochs`` would end before its iteration (one line, with what to change).
    """
    ckpt_dir = Path(ckpt_dir)
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
            same = state.get("fingerprint") == fingerprint and state.get("format") == FORMAT
            changed = schedule_changes(state.get("schedule"), schedule) if same and schedule is not None else ""
            if same and not changed:
                return state, f"resuming from {path} (iteration {state['iter']})"
            if same and resume != "restart":
                # a continuation, if the new schedule leaves iterations to train after this checkpoint (after an
                # early stop: only if it changes the stopping rule, else the run would stop again at once)
                epoch, start = int(state["sampler"]["epoch"]), int(state["sampler"]["start"])
                stopped = state["trainer"].get("stopped")
                stop_rule = any(state["schedule"].get(k) != schedule.get(k) for k in ("patience", "min_delta"))
                if epoch < schedule["epochs"] and (not stopped or stop_rule):
                    return state, f"continuing from {path} (iteration {state['iter']}, epoch {epoch + 1})"
                if stopped:
                    reason = (f"{path} stopped early ({stopped}) and the new schedule ({changed}) does not change "
                              f"train.patience or train.min_delta: another training")
                    break
                if epoch != state["schedule"]["epochs"] or start > 0:
                    raise StageError(f"train.epochs={schedule['epochs']} is fewer epochs than {path} has already "
                                     f"trained (iteration {state['iter']}, in epoch {epoch + 1} of its "
                                     f"{state['schedule']['epochs']}): raise train.epochs, or set train.resume: "
                                     f"restart to train from scratch")
                reason = (f"{path} finished its schedule and the new one ({changed}) adds no epoch to it: "
                          f"another training")
            elif same:
                reason = f"{path} was made with another schedule ({changed}) and train.resume is 'restart'"
            elif state.get("fingerprint") != fingerprint:
                reason = (f"{path} was made with other training params or data (fingerprint "
                          f"{str(state.get('fingerprint'))[:12]} != {fingerprint[:12]})")
            else:
                reason = f"{path} has checkpoint format {state.get('format')}, this trainer writes {FORMAT}"
            break
        else:
            reason = f"no readable checkpoint in {ckpt_dir}/"
    if resume == "must":
        raise StageError(f"train.resume is 'must' but there is nothing to resume: {reason}")
    return None, reason


def schedule_changes(old: dict | None, new: dict | None) -> str:
    """``"epochs 2 -> 4, lr 0.01 -> 0.02"``: the keys whose values differ between two schedule dicts
    (`schedule_params`; None counts as {}); "" when none differ."""
    old, new = old or {}, new or {}
    return ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))


def fingerprint(cfg: params_mod.Train, cache_meta: bytes, arrow_meta: bytes) -> str:
    """Which training a checkpoint belongs to: sha256 (hex) over the training params that affect the result, except
    the schedule keys (`detpipe.params.train_keys` ``"schedule"``: a checkpoint with other values of those is the same training,
    continued with another schedule: `schedule_params`), and the data's meta files (bytes)."""
    result_keys = params_mod.train_keys("result")  # not schedule, run or launch keys
    relevant = {k: v for k, v in cfg.model_dump().items() if k in result_keys}
    h = hashlib.sha256(json.dumps(relevant, sort_keys=True).encode())
    h.update(cache_meta)
    h.update(arrow_meta)
    return h.hexdigest()


def schedule_params(cfg: params_mod.Train) -> dict:
    """The schedule keys of ``cfg`` (`detpipe.params.train_keys` ``"schedule"``) and their values, as a checkpoint
    stores them."""
    keys = params_mod.train_keys("schedule")
    return {k: v for k, v in cfg.model_dump().items() if k in keys}


def check_resume(cfg: params_mod.Train, cache_dir: Path = CACHE_DIR, arrow_meta: Path = ARROW_META,
                 ckpt_dir: Path = CKPT_DIR) -> None:
    """The launcher's check of ``train.resume`` against ``ckpt_dir`` (`resume_decision`, nothing changed there),
    before any worker starts: a run that every worker would refuse (``must`` with nothing to resume, fewer epochs
    than an unfinished checkpoint has trained) stops with its one line instead of failing in each restarted worker.

    Raises:
        StageError: as `resume_decision`; missing meta files.
    """
    from detpipe.data.meta import read_cache_meta_bytes, read_meta_bytes

    if cfg.resume == "never":
        return
    arrow_meta = Path(arrow_meta)
    if not arrow_meta.is_file():
        return  # the launcher's input checks name it
    fp = fingerprint(cfg, read_cache_meta_bytes(cfg.cache_url or str(cache_dir)), read_meta_bytes(arrow_meta))
    resume_decision(cfg.resume, fp, ckpt_dir, schedule_params(cfg))
