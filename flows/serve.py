"""Serve the ``train`` flow as deployment ``train/main``: ``python -m flows.serve``.

It talks to the Prefect API at ``PREFECT_API_URL`` (e.g. a local ``prefect server start --host 127.0.0.1``),
registers the deployment and runs its flow runs in subprocesses of this process until stopped (Ctrl-C).
Trigger a run with ``prefect deployment run train/main --params '{"overrides": {"train.lr": 0.01}}' --watch``.

``python -m flows.serve --work-pool POOL`` instead registers ``train/main`` on a work pool (created as a
``process`` pool if missing) and exits; ``prefect worker start --pool POOL`` on each machine then runs it.

The deployment's parameter schema lists every params.yaml key as an optional property of ``overrides``, with
its type and bounds from `detpipe.params`, so the Prefect server rejects an unknown key or a bad value when the
run is created (``enforce_parameter_schema``), and the UI shows the keys; defaults stay in params.yaml.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import sys

from detpipe import params as params_mod

from flows.train import DEFAULT_REPO, REPO_ENV, train

ENTRYPOINT = "flows/train.py:train"


def overrides_schema() -> dict:
    """JSON schema of the ``overrides`` parameter: an object whose optional properties are the dotted
    params.yaml keys (``"train.lr"``) with `detpipe.params.Params`' per-key schema (type, bounds, enums; no
    defaults), and no other keys."""
    full = params_mod.Params.model_json_schema()
    defs = full.get("$defs", {})
    props: dict[str, dict] = {}
    for section, ref in full["properties"].items():
        sec = defs[ref["$ref"].rsplit("/", 1)[-1]]
        for key, schema in sec["properties"].items():
            schema = {k: v for k, v in copy.deepcopy(schema).items() if k not in ("default", "title")}
            props[f"{section}.{key}"] = {"title": f"{section}.{key}", **schema}
    return {"anyOf": [{"type": "object", "properties": props, "additionalProperties": False}, {"type": "null"}],
            "default": None, "title": "overrides",
            "description": 'params.yaml overrides for this run, e.g. {"train.lr": 0.01}; the run is saved as a '
                           "DVC experiment named after the flow run"}


def with_schema(deployment):
    """``deployment`` (a `RunnerDeployment` of `train`) with `overrides_schema` as its ``overrides``
    parameter schema."""
    schema = deployment._parameter_openapi_schema  # Prefect's ParameterSchema built from the signature
    position = schema.properties.get("overrides", {}).get("position", 0)
    schema.properties["overrides"] = {**overrides_schema(), "position": position}
    if "repo" in schema.properties:
        schema.properties["repo"]["description"] = (f"repository to run in (default ${REPO_ENV} of the "
                                                    f"serving process, else {DEFAULT_REPO})")
    return deployment


DESCRIPTION = ("DVC pipeline download → convert → augment → train → evaluate → export, one task per stage; "
               "DVC skips up-to-date stages; each run is a DVC experiment named after the flow run.")


def serve(name: str = "main", limit: int | None = None) -> None:
    """Register deployment ``train/<name>`` and execute its runs here until interrupted (Prefect's
    ``serve``). ``limit``: most flow runs at once (runs on the same repository queue on its lock anyway)."""
    from prefect import serve as prefect_serve

    prefect_serve(with_schema(train.to_deployment(name=name, description=DESCRIPTION)), limit=limit)


def register_on_pool(pool: str, name: str = "main", source: str | None = None) -> None:
    """Register deployment ``train/<name>`` on work pool ``pool`` (created as type ``process`` if missing),
    with the flow code taken from ``source``: this checkout by default, or a git URL for workers on other
    machines."""
    from prefect import deploy
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

    asyncio.run(ensure_pool())
    flow = train.from_source(source=source or str(DEFAULT_REPO), entrypoint=ENTRYPOINT)
    deploy(with_schema(flow.to_deployment(name=name, description=DESCRIPTION)), work_pool_name=pool,
           build=False, push=False, print_next_steps_message=False)
    print(f"deployment train/{name} is on work pool '{pool}'; start a worker with: prefect worker start --pool {pool}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="main", help="deployment name (default main: train/main)")
    parser.add_argument("--limit", type=int, default=None, help="most flow runs executed at once")
    parser.add_argument("--work-pool", default=None, help="register on this work pool instead of serving")
    parser.add_argument("--source", default=None,
                        help="with --work-pool: where workers get the code (default this checkout; a git URL "
                             "for other machines)")
    args = parser.parse_args(argv)
    if args.work_pool:
        register_on_pool(args.work_pool, args.name, args.source)
    else:
        serve(args.name, args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
