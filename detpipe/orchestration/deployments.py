"""Registering the flows' Prefect deployments (flows/serve.py): crash detection, one code source per deployment,
the ``overrides`` parameter schema, work pools.

Crashes are told by Prefect's own mechanism: every flow run sends a heartbeat every `heartbeat_s` seconds
(``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, default `HEARTBEAT_S` = 30, Prefect's minimum), and the automation
`ZOMBIE_AUTOMATION` (`ensure_zombie_automation`, the recipe of https://docs.prefect.io/v3/advanced/detect-zombie-flows)
marks a Running flow run Crashed when no heartbeat came for `zombie_after_s` seconds (``DETPIPE_ZOMBIE_AFTER_S``,
default `ZOMBIE_AFTER_S` = 90: three missed heartbeats). A run whose serve/worker process is killed dies with it
(`detpipe.orchestration.processes`), so it is Crashed at most ``zombie_after_s`` + the server's trigger evaluation period (5 s)
after the kill; ``prefect flow-run retry <id>`` then resumes it.

Each code source is its own deployment (`source_tag`, `claim`): a name already registered for another source (a
checkout, another git URL or branch) is refused, so a retry always runs the code its deployment names.

The ``overrides`` parameter's schema (`with_schema`) lists every params.yaml key as an optional property, with its
type and bounds from `detpipe.params`, so the Prefect server rejects an unknown key or a bad value when a run is
created (``enforce_parameter_schema``), and the UI shows the keys; defaults stay in params.yaml.
"""
from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from pathlib import Path

from detpipe.orchestration.overrides import json_schema

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


def heartbeat_env() -> dict[str, str]:
    """The environment a flow run needs to send heartbeats every `heartbeat_s` seconds (raises as it does)."""
    return {HEARTBEAT_ENV: str(heartbeat_s())}


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
    each heartbeat, whose action sets the run Crashed. Raises `SystemExit` as `zombie_after_s` does, and
    Prefect's errors when its API cannot be reached."""
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


def with_schema(deployment, repo_description: str | None = None):
    """``deployment`` (a `prefect.deployments.runner.RunnerDeployment` of a flow with parameters ``overrides``
    and ``repo``) with `detpipe.orchestration.overrides.json_schema` as its ``overrides`` parameter schema and, if given,
    ``repo_description`` as the ``repo`` parameter's description. Returns ``deployment``, changed in place."""
    # Prefect 3.8 has no public way to set a RunnerDeployment's parameter schema: it is the private attribute
    # `_parameter_openapi_schema`, built from the flow's signature by `Flow.to_deployment`/`from_flow` (which take
    # no schema argument); `prefect deploy` (prefect/cli/deploy/_core.py) sets the same attribute.
    schema = deployment._parameter_openapi_schema   # Prefect's ParameterSchema
    position = schema.properties.get("overrides", {}).get("position", 0)
    schema.properties["overrides"] = {**json_schema(), "position": position}
    if repo_description and "repo" in schema.properties:
        schema.properties["repo"]["description"] = repo_description
    return deployment


def source_tag(source: str | None, branch: str | None, checkout: Path) -> str:
    """The tag naming a deployment's code source: ``source:<git url>@<branch>`` for a git ``source``, else
    ``source:checkout:<checkout>`` (a folder on the serving machine)."""
    return f"source:{source}@{branch}" if source else f"source:checkout:{checkout}"


def claim(deployment: str, tag: str) -> None:
    """Refuse (`SystemExit` with one line) to register ``deployment`` (``<flow>/<name>``) when it exists for
    another code source than ``tag`` says (`source_tag`): registering would silently change which code its runs
    and retries use."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    async def existing() -> list[str] | None:
        async with get_client() as client:
            try:
                return list((await client.read_deployment_by_name(deployment)).tags)
            except ObjectNotFound:
                return None

    tags = asyncio.run(existing())
    other = [t for t in tags or [] if t.startswith("source:") and t != tag]
    if other:
        raise SystemExit(f"error: deployment {deployment} runs code from {other[0][7:]}, not {tag[7:]}: register "
                         "this source under its own name (--name)")


def ensure_process_pool(pool: str) -> bool:
    """Create work pool ``pool`` of type ``process`` unless it exists; returns whether it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    async def create() -> bool:
        async with get_client() as client:
            try:
                await client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
                return True
            except ObjectAlreadyExists:
                return False

    return asyncio.run(create())
