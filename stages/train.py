"""Train stage: a torchvision detector trained with DDP from the augmentation cache, resumable at any point.

``python -m stages.train`` (the DVC stage command) checks params and inputs, then launches
``torchrun --rdzv-backend c10d ... -m stages.train`` (`detpipe.launch.jobs`; under Slurm with ``train.launcher:
slurm``); each worker (detected by torchrun's ``LOCAL_RANK`` variable) trains with DDP — gloo on CPU, nccl on
CUDA. A worker binds itself to its launcher as it starts (exec'd: before it imports torch): the kernel kills it when
the launcher dies, at once if the launcher died before (`detpipe.core.lifeline.die_with_launcher`), so a ``kill -9``
of the stage never leaves workers training on beside the next run. ``python -m detpipe.launch.emit slurm|k8s``
writes the Slurm script / Kubernetes manifest instead (docs/multi-node.md; not imported here, so editing it does not
invalidate trained models).

Outputs: ``checkpoints/ckpt-NNNNNNN.pt`` (kept across runs: ``persist: true`` in dvc.yaml), ``models/model.pt``
(``{"model": state_dict, "config": {...}}`` for the evaluate and export stages), ``dvclive/`` (training
curves). A checkpoint holds model, optimizer, grad scaler, every hook's state, the iteration (hence the
sampler's position in its epoch) and every rank's RNG states, plus a fingerprint of the params and data
that produced it: ``train.resume: auto`` resumes from the newest checkpoint of the same training, continues it
when only schedule keys changed and they add epochs (``dvc exp run -S train.epochs=<more>``: docs/train.md,
"Continuing a run"), and otherwise starts fresh, saying why; ``restart`` resumes identical params only; ``never``
always starts fresh; ``must`` stops with an error when there is nothing to resume.

The work itself is `detpipe.engine.trainer.train`. Without a terminal, a progress line (iteration/total, epoch, loss, lr,
images/s, ETA) is logged every ``train.log_every_s`` seconds. SIGTERM or SIGINT stops training with one line
``error: interrupted by SIGTERM at iteration N; checkpoint ckpt-NNNNNNN.pt kept`` and exit status 128 + signal;
that checkpoint is complete (written atomically) and the next run resumes from it.
"""
from __future__ import annotations

import os

from detpipe.core.errors import run_program
from detpipe.core.lifeline import die_with_launcher

# Only light modules above (standard library only); the rest (torch, pydantic, pyarrow) is imported in `main`,
# so that a worker started by exec is bound to its launcher before it imports them.

# What torchrun's agent imports once before it forks the workers (`detpipe.launch.worker_start.WORKER_START_ENV`).
WORKER_PRELOAD = ("detpipe.engine.trainer", "detpipe.core.distributed")


def main(argv: list[str] | None = None) -> None:
    """Worker (under torchrun): first bind to the launcher (`detpipe.core.lifeline.die_with_launcher`), then train
    (`detpipe.engine.trainer.train`). Otherwise check inputs and launch the workers
    (`detpipe.launch.stage.run_stage`, `detpipe.launch.jobs`)."""
    worker = "LOCAL_RANK" in os.environ  # `detpipe.launch.stage.is_worker`, before anything heavy is imported
    if worker:
        die_with_launcher()
    import argparse

    from detpipe.launch.stage import LaunchParams, run_stage
    from detpipe.params import load

    ap = argparse.ArgumentParser(prog="python -m stages.train", description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    cfg = load("train")

    def work() -> None:
        from detpipe.engine.trainer import train
        from detpipe.core.distributed import collective_errors

        with collective_errors():  # a timed-out collective: one line naming the lost peer, exit status 2
            train(cfg, eval_fn_factory=eval_fn_factory)

    def eval_fn_factory(cache_root, arrow_meta):  # imported only with train.eval_every (COCOeval, pycocotools)
        from detpipe.evaluation.periodic import make_eval_fn

        return make_eval_fn(cache_root, arrow_meta)

    def prepare() -> None:
        from detpipe.engine.checkpoints import check_resume  # torch, not torchvision
        from detpipe.launch import jobs
        from detpipe.launch.worker_start import prepare_fork, worker_start

        if worker_start() == "fork":
            prepare_fork()  # before anything runs in torch: the workers are forked from this process
        check_resume(cfg)  # a resume every worker would refuse: one line here, no restarted workers
        jobs.check_inputs(cfg)

    def submit(launch: LaunchParams, module: str) -> None:
        from detpipe.launch import jobs

        jobs.launch(cfg)  # torchrun here with `launch`, or the Slurm job (train.launcher)

    run_stage("stages.train", LaunchParams.of_train(cfg), work, prepare=prepare, submit=submit)


if __name__ == "__main__":
    run_program(main)
