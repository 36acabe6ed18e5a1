"""Serve the ``train`` flow as deployment ``train/main``: ``python -m flows.serve``.

Crashes are told by Prefect's own mechanism: every flow run sends a heartbeat every `heartbeat_s` seconds
(``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, default `HEARTBEAT_S` = 30, Prefect's minimum), and the automation
`ZOMBIE_AUTOMATION` (created or updated here, the recipe of https://docs.prefect.io/v3/advanced/detect-zombie-flows)
marks a Running flow run Crashed when no heartbeat came for `zombie_after_s` seconds (``DETPIPE_ZOMBIE_AFTER_S``,
default `ZOMBIE_AFTER_S` = 90: three missed heartbeats). A run whose serve/worker process is killed dies with it
(`detpipe.ops.processes`), so it is Crashed at most ``zombie_after_s`` + the server's trigger evaluation period (5 s)
after the kill; ``prefect flow-run retry <id>`` then resumes it. Runs at once: the deployment's
``concurrency_limit`` (``flows.max_parallel``); more wait in Prefect's AwaitingConcurrencySlot state.

It talks to the Prefect API at ``PREFECT_API_URL`` (e.g. a local ``prefect server start --host 127.0.0.1``),
registers the deployment and runs its flow runs in subprocesses of this process until stopped (Ctrl-C).
Trigger a run with ``prefect deployment run train/main --params '{"overrides": {"train.lr": 0.01}}' --watch``.

``python -m flows.serve --work-pool POOL`` instead registers ``train/main`` on a work pool (created as a
``process`` pool if missing) and exits; ``prefect worker start --pool POOL`` on each machine then runs it.
``--source GIT_URL [--branch B]`` registers ``train/<B>`` (or ``--name``) whose workers clone that branch into a
temporary folder: its runs sync with the remotes (``DETPIPE_SYNC=1``, `detpipe.ops.remotes`). Each code source is
its own deployment: a name already registered for another source (the checkout, another URL or branch) is
refused, so a retry always runs the code its deployment names.

The deployment's parameter schema lists every params.yaml key as an optional property of ``overrides``, with
its type and bounds from `detpipe.params`, so the Prefect server rejects an unknown key or a bad value when the
run is created (``enforce_parameter_schema``), and the UI shows the keys; defaults stay in params.yaml.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from datetime import timedelta

from detpipe import params as params_mod
from detpipe.ops.overrides import json_schema

from detpipe.ops.remotes import SYNC_ENV

from flows.sweep import sweep
from flows.train import DEFAULT_REPO, REPO_ENV, train

ENTRYPOINT = "flows/train.py:train"
HEARTBEAT_S = 30           # default seconds between heartbeats: Prefect's minimum
ZOMBIE_AFTER_S = 90        # default seconds without heartbeat before a run is Crashed: three missed heartbeats
HEARTBEAT_ENV = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"   # Prefect's own setting (>= 30)
ZOMBIE_ENV = "DETPIPE_ZOMBIE_AFTER_S"
ZOMBIE_AUTOMATION = "detpipe: crash flow runs without heartbeat"


def heartbeat_s() -> int:
    """Seconds between a flow run's heartbeats: ``$PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, else `HEARTBEAT_S`.
    Raises `SystemExit` (one line) for a value that is not an integer >= 30 (Prefect's minimum)."""
    value = os.environ.get(HEARTBEAT_ENV, str(HEARTBEAT_S))
    if not value.strip().isdigit() or int(value) < 30:
        raise SystemExit(f"error: {HEARTBEAT_ENV}={value!r}: expected whole seconds >= 30 (Prefect's minimum)")
    return int(value)


def zombie_after_s() -> int:
    """Seconds without a heartbeat after which a Running flow run is marked Crashed: ``$DETPIPE_ZOMBIE_AFTER_S``,
    else `ZOMBIE_AFTER_S` (at least three heartbeats when the heartbeat interval is longer than 30 s). Raises
    `SystemExit` (one line) unless it is an integer longer than the heartbeat interval: a live run whose next
    heartbeat is due would be marked Crashed."""
    beat = heartbeat_s()
    value = os.environ.get(ZOMBIE_ENV)
    if value is None:
        return max(ZOMBIE_AFTER_S, 3 * beat)
    if not value.strip().isdigit() or int(value) <= beat:
        raise SystemExit(f"error: {ZOMBIE_ENV}={value!r}: expected whole seconds longer than the heartbeat "
                         f"interval ({beat} s)")
    return int(value)


def ensure_zombie_automation() -> None:
    """Create `ZOMBIE_AUTOMATION` on the Prefect server (or update it when its threshold differs): a proactive
    event trigger per flow run expecting another heartbeat or a final state within `zombie_after_s` seconds of
    each heartbeat, whose action sets the run Crashed."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    after_s = zombie_after_s()
    try:
        existing = Automation.read(name=ZOMBIE_AUTOMATION)
    except ValueError:
        existing = None
    if existing is not None and existing.trigger.within == timedelta(seconds=after_s):
        return
    final = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    automation = Automation(name=ZOMBIE_AUTOMATION, trigger=EventTrigger(
        after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.heartbeat", *final},
        match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
        for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
        within=timedelta(seconds=after_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {after_s} s: its process died")])
    if existing is None:
        automation.create()
    else:
        automation.id = existing.id
        automation.update()


def with_schema(deployment):
    """``deployment`` (a `RunnerDeployment` of `train`) with `detpipe.ops.overrides.json_schema` as its
    ``overrides`` parameter schema."""
    schema = deployment._parameter_openapi_schema  # Prefect's ParameterSchema built from the signature
    position = schema.properties.get("overrides", {}).get("position", 0)
    schema.properties["overrides"] = {**json_schema(), "position": position}
    if "repo" in schema.properties:
        schema.properties["repo"]["description"] = (f"repository to run in (default ${REPO_ENV} of the "
                                                    f"serving process, else {DEFAULT_REPO})")
    return deployment


DESCRIPTION = ("DVC pipeline download → convert → augment → train → evaluate → export, one task per stage; "
               "DVC skips up-to-date stages; each run is a DVC experiment named after the flow run.")


SWEEP_DESCRIPTION = ("Parallel experiments: grid {'train.lr': [0.01, 0.02]} and/or runs [{...}, ...] of overrides; "
                     "shared stages run once, then at most flows.max_parallel train runs at once.")


def max_parallel(limit: int | None) -> int:
    """``limit``, else ``flows.max_parallel`` of the served repository's params.yaml."""
    return limit or params_mod.load("flows", path=DEFAULT_REPO / "params.yaml").max_parallel


def source_tag(source: str | None, branch: str | None) -> str:
    """The tag naming a deployment's code source: ``source:checkout:<path>`` or ``source:<git url>@<branch>``."""
    return f"source:{source}@{branch}" if source else f"source:checkout:{DEFAULT_REPO}"


def claim(name: str, tag: str) -> None:
    """Refuse (`SystemExit` with one line) to register ``train/<name>`` when it exists for another code source
    than ``tag`` says (`source_tag`): registering would silently change which code its runs and retries use."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    async def existing() -> list[str] | None:
        async with get_client() as client:
            try:
                return list((await client.read_deployment_by_name(f"train/{name}")).tags)
            except ObjectNotFound:
                return None

    tags = asyncio.run(existing())
    other = [t for t in tags or [] if t.startswith("source:") and t != tag]
    if other:
        raise SystemExit(f"error: deployment train/{name} runs code from {other[0][7:]}, not {tag[7:]}: register "
                         "this source under its own name (--name)")


def serve(name: str = "main", limit: int | None = None) -> None:
    """Register deployment ``train/<name>`` (at most `max_parallel` runs at once) and execute its runs here
    until interrupted (Prefect's ``serve``), with heartbeats and `ensure_zombie_automation`."""
    from prefect import serve as prefect_serve

    os.environ[HEARTBEAT_ENV] = str(heartbeat_s())  # inherited by the runs
    ensure_zombie_automation()
    claim(name, source_tag(None, None))
    deployment = train.to_deployment(name=name, description=DESCRIPTION, concurrency_limit=max_parallel(limit),
                                     tags=[source_tag(None, None)])
    sweeps = sweep.to_deployment(name="sweep", description=SWEEP_DESCRIPTION)
    prefect_serve(with_schema(deployment), sweeps)


def register_on_pool(pool: str, name: str | None = None, source: str | None = None,
                     branch: str | None = None) -> str:
    """Register deployment ``train/<name>`` on work pool ``pool`` (created as type ``process`` if missing),
    with the flow code taken from ``source``: this checkout by default (name ``main``), or branch ``branch``
    (default ``main``) of a git URL for workers on other machines (name ``branch``; runs sync with the
    remotes). Returns the deployment's name; raises `SystemExit` when `claim` refuses the name."""
    from prefect import deploy
    from prefect.runner.storage import GitRepository
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    async def ensure_pool() -> None:
        async with get_client() as client:
            try:
                await client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
                print(f"created work pool '{pool}' (type process)")
            except ObjectAlreadyExists:
                pass

    branch = (branch or "main") if source else None
    name = name or branch or "main"
    tag = source_tag(source, branch)
    claim(name, tag)
    asyncio.run(ensure_pool())
    ensure_zombie_automation()
    env = {HEARTBEAT_ENV: str(heartbeat_s())} | ({SYNC_ENV: "1"} if source else {})
    code = GitRepository(url=source, branch=branch) if source else str(DEFAULT_REPO)
    flow = train.from_source(source=code, entrypoint=ENTRYPOINT)
    deployment = flow.to_deployment(name=name, description=DESCRIPTION, concurrency_limit=max_parallel(None),
                                    job_variables={"env": env}, tags=[tag])
    deploy(with_schema(deployment), work_pool_name=pool, build=False, push=False, print_next_steps_message=False)
    print(f"deployment train/{name} ({tag[7:]}) is on work pool '{pool}'; start a worker with: "
          f"prefect worker start --pool {pool}")
    return name


def main(argv: list[str] | None = None) -> int:
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
