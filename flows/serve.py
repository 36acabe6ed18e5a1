"""Serve the flows as deployments ``train/main`` and ``sweep/main``: ``python -m flows.serve``.

It talks to the Prefect API at ``PREFECT_API_URL`` (e.g. a local ``prefect server start --host 127.0.0.1``),
registers the deployments and runs their flow runs in subprocesses of this process until stopped (Ctrl-C).
Trigger a run with ``prefect deployment run train/main --params '{"overrides": {"train.lr": 0.01}}' --watch``.
Runs at once: the deployment's ``concurrency_limit`` (``flows.max_parallel``); more wait in Prefect's
AwaitingConcurrencySlot state. Runs send heartbeats, and a run whose process died is marked Crashed
(`detpipe.orchestration.deployments`); ``prefect flow-run retry <id>`` then resumes it.

``python -m flows.serve --work-pool POOL`` instead registers ``train/main`` on a work pool (created as a
``process`` pool if missing) and exits; ``prefect worker start --pool POOL`` on each machine then runs it.
``--source GIT_URL [--branch B]`` registers ``train/<B>`` (or ``--name``) whose workers clone that branch into a
temporary folder: its runs sync with the remotes (``DETPIPE_SYNC=1``, `detpipe.orchestration.remotes`). Each code source is
its own deployment: a name already registered for another source is refused (`detpipe.orchestration.deployments.claim`).
The ``overrides`` parameter's schema lists every params.yaml key (`detpipe.orchestration.deployments.with_schema`).
"""
from __future__ import annotations

import argparse
import os
import sys

from detpipe import params as params_mod
from detpipe.orchestration import deployments
from detpipe.orchestration.remotes import SYNC_ENV
from flows.sweep import sweep
from flows.train import DEFAULT_REPO, REPO_ENV, train

ENTRYPOINT = "flows/train.py:train"
DESCRIPTION = ("DVC pipeline download → convert → augment → train → evaluate → export, one task per stage; "
               "DVC skips up-to-date stages; each run is a DVC experiment named after the flow run.")
SWEEP_DESCRIPTION = ("Parallel experiments: grid {'train.lr': [0.01, 0.02]} and/or runs [{...}, ...] of overrides; "
                     "shared stages run once, then at most flows.max_parallel train runs at once.")
REPO_DESCRIPTION = f"repository to run in (default ${REPO_ENV} of the serving process, else {DEFAULT_REPO})"


def max_parallel(limit: int | None) -> int:
    """``limit``, else ``flows.max_parallel`` of the served repository's params.yaml."""
    return limit or params_mod.load("flows", path=DEFAULT_REPO / "params.yaml").max_parallel


def serve(name: str = "main", limit: int | None = None) -> None:
    """Register deployments ``train/<name>`` (at most `max_parallel` runs at once) and ``sweep/<name>`` and
    execute their runs here until interrupted (Prefect's ``serve``), with heartbeats and crash detection.
    Raises `SystemExit` when a setting is bad or `detpipe.orchestration.deployments.claim` refuses the name."""
    from prefect import serve as prefect_serve

    os.environ.update(deployments.heartbeat_env())  # inherited by the runs
    deployments.ensure_zombie_automation()
    tag = deployments.source_tag(None, None, DEFAULT_REPO)
    deployments.claim(f"{train.name}/{name}", tag)
    runs = train.to_deployment(name=name, description=DESCRIPTION, concurrency_limit=max_parallel(limit),
                               tags=[tag])
    sweeps = sweep.to_deployment(name=name, description=SWEEP_DESCRIPTION)
    prefect_serve(deployments.with_schema(runs, REPO_DESCRIPTION), sweeps)


def register_on_pool(pool: str, name: str | None = None, source: str | None = None,
                     branch: str | None = None) -> str:
    """Register deployment ``train/<name>`` on work pool ``pool`` (created as type ``process`` if missing),
    with the flow code taken from ``source``: this checkout by default (name ``main``), or branch ``branch``
    (default ``main``) of a git URL for workers on other machines (name ``branch``; runs sync with the
    remotes). Returns the deployment's name; raises `SystemExit` when `detpipe.orchestration.deployments.claim` refuses
    the name or a setting is bad."""
    from prefect import deploy
    from prefect.runner.storage import GitRepository

    branch = (branch or "main") if source else None
    name = name or branch or "main"
    tag = deployments.source_tag(source, branch, DEFAULT_REPO)
    deployments.claim(f"{train.name}/{name}", tag)
    if deployments.ensure_process_pool(pool):
        print(f"created work pool '{pool}' (type process)")
    deployments.ensure_zombie_automation()
    env = deployments.heartbeat_env() | ({SYNC_ENV: "1"} if source else {})
    code = GitRepository(url=source, branch=branch) if source else str(DEFAULT_REPO)
    flow = train.from_source(source=code, entrypoint=ENTRYPOINT)
    deployment = flow.to_deployment(name=name, description=DESCRIPTION, concurrency_limit=max_parallel(None),
                                    job_variables={"env": env}, tags=[tag])
    deploy(deployments.with_schema(deployment, REPO_DESCRIPTION), work_pool_name=pool, build=False, push=False,
           print_next_steps_message=False)
    print(f"deployment {train.name}/{name} ({tag[7:]}) is on work pool '{pool}'; start a worker with: "
          f"prefect worker start --pool {pool}")
    return name


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.serve [--name N] [--limit L]`` serves; with ``--work-pool POOL [--source URL --branch B]``
    registers on a work pool and exits. Exit status 0; `SystemExit` with one line on a refused name or setting."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=None,
                        help="deployment name (default: main for this checkout, the branch for --source)")
    parser.add_argument("--limit", type=int, default=None,
                        help="most flow runs at once (default flows.max_parallel of params.yaml)")
    parser.add_argument("--work-pool", default=None, help="register on this work pool instead of serving")
    parser.add_argument("--source", default=None,
                        help="with --work-pool: where workers get the code (default this checkout; a git URL "
                             "for other machines: its runs pull from and push to the remotes)")
    parser.add_argument("--branch", default=None, help="with --source: the branch workers clone (default main)")
    args = parser.parse_args(argv)
    if args.work_pool:
        register_on_pool(args.work_pool, args.name, args.source, args.branch)
    else:
        serve(args.name or "main", args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
