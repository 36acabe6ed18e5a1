"""Training loop skeleton, in the style of detectron2's ``engine/train_loop.py``: `TrainerBase`, `HookBase` and
the `EventStorage` through which hooks exchange values.

The loop (`TrainerBase.train`) is short::

    before_train
    for each iteration: before_step, run_step (loads the input, after_load, forward/backward), after_step,
                        storage.step()
    after_train          (in ``finally``: also after an error or an interrupt)

Every cross-cutting concern (LR schedule, EMA, evaluation, checkpoints, metrics, progress) is a `HookBase`.
Hooks never share dicts: a value one hook (or ``run_step``) produces for another goes through
``trainer.storage`` (`EventStorage.put_scalar` / `EventStorage.latest`), and the rows of values kept for the
training curves live there too, so the storage is part of every checkpoint.
"""
from __future__ import annotations

import weakref


class EventStorage:
    """The values of the current iteration, and the history of kept rows, shared by the trainer and its hooks.

    ``put_scalar(name, value)`` records a float for iteration ``iter`` (the trainer sets it before each
    iteration); `latest` returns every name's most recent ``(value, iteration)``. At the end of each iteration
    the trainer calls `step`, which appends the iteration's values as a row ``{"step": iter + 1, name: value}``
    to `history` when the iteration is a multiple of ``keep_every``, is the last one, or a value was put with
    ``keep=True`` (e.g. evaluation results). `history` goes into the checkpoint (`state_dict`), so a resumed
    run has exactly the rows an uninterrupted one would (no gap, no duplicate).

    Like detectron2's ``EventStorage`` (``detectron2/utils/events.py``), minus smoothing and images.
    """

    def __init__(self, keep_every: int = 1, start_iter: int = 0):
        self.keep_every = keep_every
        self.iter = start_iter
        self.history: list[dict] = []
        self._latest: dict[str, tuple[float, int]] = {}
        self._current: dict[str, float] = {}
        self._keep = False

    def put_scalar(self, name: str, value: float | str, keep: bool = False) -> None:
        """Record ``value`` (converted to float; a ``str`` kept as it is, e.g. a search trial's state, which
        DVCLive writes to metrics.json as text) under ``name`` for the current iteration; ``keep=True`` makes
        this iteration's row go into `history` whatever ``keep_every`` says."""
        value = value if isinstance(value, str) else float(value)
        self._latest[name] = (value, self.iter)
        self._current[name] = value
        self._keep = self._keep or keep

    def put_scalars(self, keep: bool = False, **values: float) -> None:
        """`put_scalar` for each keyword."""
        for name, value in values.items():
            self.put_scalar(name, value, keep)

    def latest(self) -> dict[str, tuple[float, int]]:
        """``{name: (value, iteration)}``: the most recent value of every name (a copy)."""
        return dict(self._latest)

    def value(self, name: str, default: float = float("nan")) -> float:
        """The most recent value put under ``name`` (``default`` if none)."""
        return self._latest.get(name, (default, -1))[0]

    def step(self, last: bool = False) -> dict | None:
        """Close the current iteration: return its row (also appended to `history` when kept, see the class
        docstring) or None when nothing was put, then move on to iteration ``iter + 1``."""
        done = self.iter + 1
        row = {"step": done, **self._current} if self._current else None
        if row is not None and (done % self.keep_every == 0 or last or self._keep):
            self.history.append(row)
        self._current, self._keep = {}, False
        self.iter = done
        return row

    def state_dict(self) -> dict:
        """The kept rows and the latest values (plain types, for ``torch.load(weights_only=True)``)."""
        return {"history": [dict(r) for r in self.history],
                "latest": {k: [v, i] for k, (v, i) in self._latest.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.history = [dict(r) for r in state["history"]]
        self._latest = {k: (float(v), int(i)) for k, (v, i) in state["latest"].items()}


class HookBase:
    """One concern of training (LR schedule, EMA, evaluation, checkpoints, metrics, progress...), called around
    the loop of `TrainerBase.train`.

    When each method runs (all ranks call every method; a hook that writes files does so on rank 0):

    - ``before_train``: once, after a checkpoint (if any) was loaded and before the first iteration.
    - ``before_step``: before each iteration's ``run_step``; ``trainer.iter`` is that iteration (0-based).
    - ``after_load(batch)``: inside ``run_step``, once the iteration's input is loaded and before the forward pass
      (`TrainerBase.loaded`): ``batch`` is this rank's list of micro-batches ``(images, targets)``, the very
      objects the model is then given; a hook reads them and must not modify them.
    - ``after_step``: after ``run_step`` and before ``trainer.iter`` advances; the iteration's values are in
      ``trainer.storage`` (`EventStorage.latest`).
    - ``after_train``: once, in a ``finally``: also when a step raised or the run was interrupted, so it must
      only release resources (close files and bars, flush logs) unless ``trainer.iter == trainer.max_iter``
      (training completed).

    What a hook may do: read the trainer's attributes (``iter``, ``start_iter``, ``max_iter``, ``rank``,
    ``model``, ``optimizer``...), change the optimizer's param groups or the model's weights, put values into
    ``trainer.storage`` and read values other hooks put there. It must not set attributes on the trainer nor
    share mutable objects with other hooks: values travel through the storage, so the hooks' order does not
    matter, with one stated exception: `detpipe.engine.hooks.EvalHook` evaluates the weights of the
    ``EMAHook`` it is given, which must therefore be registered before it (EvalHook checks this).

    State: anything a resumed run needs to continue exactly goes in `state_dict` (plain types and tensors
    only: checkpoints are read with ``torch.load(weights_only=True)``); the trainer saves it in every checkpoint
    under the hook's class name and hands it back to `load_state_dict` before ``before_train``.

    ``self.trainer`` is a weak reference (``weakref.proxy``) set by `TrainerBase.register_hooks`, so hooks and
    trainer do not keep each other alive.
    """

    trainer: "TrainerBase"

    def before_train(self) -> None:
        """Called once before the first iteration."""

    def after_train(self) -> None:
        """Called once after the last iteration, or after an error or interrupt (``finally``)."""

    def before_step(self) -> None:
        """Called before each iteration's ``run_step``."""

    def after_load(self, batch: list) -> None:
        """Called inside each iteration's ``run_step`` with its loaded input, before the forward pass."""

    def after_step(self) -> None:
        """Called after each iteration's ``run_step``."""

    def state_dict(self) -> dict:
        """The hook's state for the checkpoint (plain types and tensors only)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""


class TrainerBase:
    """Iteration-based loop over hooks. ``self.iter`` is the index of the current iteration (0-based); after
    training completed it equals ``max_iter``. Subclasses implement `run_step`, which puts its values (loss,
    timings) into ``self.storage``."""

    def __init__(self, keep_every: int = 1) -> None:
        self.hooks: list[HookBase] = []
        self.iter = self.start_iter = self.max_iter = 0
        self.storage = EventStorage(keep_every)
        self.stop_reason: str | None = None

    def register_hooks(self, hooks: list[HookBase]) -> None:
        """Append ``hooks`` (called in this order) and give each a weak reference to this trainer."""
        for h in hooks:
            h.trainer = weakref.proxy(self)
        self.hooks.extend(hooks)

    def train(self, start_iter: int, max_iter: int) -> None:
        """Run iterations ``start_iter .. max_iter - 1``, or until a hook calls `request_stop`; ``after_train`` runs
        whatever happens (``finally``)."""
        self.start_iter, self.max_iter = start_iter, max_iter
        self.iter = self.storage.iter = start_iter
        try:
            for h in self.hooks:
                h.before_train()
            while self.iter < max_iter and self.stop_reason is None:
                for h in self.hooks:
                    h.before_step()
                self.run_step()
                for h in self.hooks:
                    h.after_step()
                self.storage.step(last=self.iter + 1 == max_iter or self.stop_reason is not None)
                self.iter += 1
        finally:
            for h in self.hooks:
                h.after_train()

    def request_stop(self, reason: str) -> None:
        """End training after the current iteration (or, from ``before_train``, before the first), for ``reason``
        (early stopping). A distributed hook must call it on every rank at the same iteration."""
        self.stop_reason = reason

    def run_step(self) -> None:
        """One iteration of training; it calls `loaded` with its input before the forward pass."""
        raise NotImplementedError

    def loaded(self, batch: list) -> None:
        """Hand the current iteration's loaded input to every hook's ``after_load`` (called by `run_step`)."""
        for h in self.hooks:
            h.after_load(batch)

    def hooks_state(self) -> dict:
        """``{hook class name: hook.state_dict()}`` for the checkpoint."""
        return {type(h).__name__: h.state_dict() for h in self.hooks}

    def load_hooks_state(self, state: dict) -> None:
        """Inverse of `hooks_state` (hooks absent from ``state`` keep their initial state)."""
        for h in self.hooks:
            if type(h).__name__ in state:
                h.load_state_dict(state[type(h).__name__])
