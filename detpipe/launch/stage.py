"""One way to run a stage's work: be a worker (under torchrun: run the work here) or launch the workers.

`run_stage` is what the train and evaluate stages call; `LaunchParams` is what a launch needs (torchrun's agent,
the rendezvous, restarts, the workers' environment), built from a stage's own params section (`LaunchParams.of_train`,
`LaunchParams.of_evaluate`), so no stage pretends to be another to be launched.

Only light modules here (standard library, pydantic, `detpipe.launch.torchrun`): a train worker imports this before
torch, and the launcher side never imports the engine.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Optional, TypeVar

from pydantic import BaseModel, ConfigDict

from detpipe.params import Evaluate, Train, train_keys

T = TypeVar("T")

WORKER_ENV = "LOCAL_RANK"
"""The variable torchrun sets in every worker it starts: a process that has it is a worker (`is_worker`)."""


def _train_default(key: str):
    return Train.model_fields[key].default


class LaunchParams(BaseModel):
    """What launching a stage's workers needs. Field meanings and defaults are the `detpipe.params.Train` fields of
    the same name (the train keys of role ``launch``, plus ``nproc_per_node`` and ``threads``); ``params_digest``
    is the sha256 (hex) of the stage's whole params section, from which the default rendezvous id is derived
    (`detpipe.launch.torchrun_args.default_run_id`: the same on every node that runs the same params)."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    nproc_per_node: int = _train_default("nproc_per_node")
    nnodes: str = _train_default("nnodes")
    rdzv_endpoint: str = _train_default("rdzv_endpoint")
    rdzv_id: Optional[str] = _train_default("rdzv_id")
    rdzv_join_timeout_s: int = _train_default("rdzv_join_timeout_s")
    rdzv_last_call_s: int = _train_default("rdzv_last_call_s")
    max_restarts: int = _train_default("max_restarts")
    collective_timeout_s: float = _train_default("collective_timeout_s")
    socket_ifname: Optional[str] = _train_default("socket_ifname")
    threads: int = _train_default("threads")
    params_digest: str = ""

    @classmethod
    def of_train(cls, cfg: Train) -> LaunchParams:
        """The train stage's launch: its ``launch`` keys (`detpipe.params.train_keys`) that torchrun uses,
        ``nproc_per_node`` and ``threads``."""
        keys = (set(cls.model_fields) & train_keys("launch")) | {"nproc_per_node", "threads"}
        return cls(**{k: getattr(cfg, k) for k in keys}, params_digest=_digest(cfg))

    @classmethod
    def of_evaluate(cls, cfg: Evaluate) -> LaunchParams:
        """The evaluate stage's launch: ``evaluate.nproc_per_node`` workers on this node (a free port on 127.0.0.1),
        no restarts (a failed evaluation is rerun by DVC, not resumed)."""
        return cls(nproc_per_node=cfg.nproc_per_node, nnodes="1", max_restarts=0, params_digest=_digest(cfg))


def _digest(cfg: BaseModel) -> str:
    return hashlib.sha256(json.dumps(cfg.model_dump(), sort_keys=True).encode()).hexdigest()


def is_worker() -> bool:
    """True in a process torchrun started as a worker (`WORKER_ENV` is set)."""
    return WORKER_ENV in os.environ


def run_stage(module: str, launch: LaunchParams, work: Callable[[], T], *, in_process: bool = False,
              prepare: Callable[[], None] | None = None,
              submit: Callable[[LaunchParams, str], None] | None = None) -> T | None:
    """Run a stage: in a worker (`is_worker`), or with ``in_process``, ``work()`` here and its result returned;
    otherwise ``prepare()`` (checks every worker would otherwise fail on, done once here), then launch
    ``python -m <module>`` workers with ``submit(launch, module)`` (default:
    `detpipe.launch.torchrun.launch_local`), each of which must call `run_stage` again (and so runs ``work``).

    Args:
        module: the module each worker runs (``"stages.train"``).
        launch: the launch settings (`LaunchParams`).
        work: the stage's work, run by every worker.
        in_process: run ``work`` here instead of launching (evaluate with one process).
        prepare: run before launching, in the launcher.
        submit: launch instead of `launch_local` (the train stage's Slurm submission).
    Returns:
        ``work()``'s result here, None after a launch.
    Raises:
        StageError: as ``work``, ``prepare`` and the launch (a failed worker: `detpipe.launch.torchrun.run_torchrun`).
    """
    if is_worker() or in_process:
        return work()
    if prepare is not None:
        prepare()
    if submit is None:
        from detpipe.launch.torchrun import launch_local as submit
    submit(launch, module)
    return None
