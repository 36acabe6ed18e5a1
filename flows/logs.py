"""Follow a flow run's log as it is written: ``python -m flows.logs <flow run id or name>``.

``prefect deployment run ... --watch`` shows state changes only and ``prefect flow-run logs`` (Prefect 3.8) prints
what is there and exits; this prints every log line of the run (the stages' own output included: the flow sends
it to Prefect's API line by line) as it arrives, polling the API every ``--poll`` seconds, until the run is in a
final state. Exit status 0 when it Completed, 1 otherwise, 2 when no such run exists.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}
PAGE = 200
LATE_S = 60.0   # logs reach the API in batches: a line may arrive after later-stamped ones by up to this long


async def _find(client, run: str):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    try:
        return await client.read_flow_run(uuid.UUID(run))
    except ValueError:
        found = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run])))
        return found[0] if found else None


async def follow(run: str, poll_s: float = 2.0, out=sys.stdout) -> str | None:
    """Print the log of flow run ``run`` (id or name) to ``out`` until the run is final; return its final state
    type (e.g. ``"COMPLETED"``), or None when there is no such run."""
    from datetime import timedelta

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    async with get_client() as client:
        flow_run = await _find(client, run)
        if flow_run is None:
            return None
        seen: set = set()
        since = None
        while True:
            state = (await client.read_flow_run(flow_run.id)).state_type.value   # read before the logs
            log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id]),
                                   timestamp=LogFilterTimestamp(after_=since) if since else None)
            offset, newest = 0, since
            while logs := await client.read_logs(log_filter=log_filter, sort=LogSort.TIMESTAMP_ASC, limit=PAGE,
                                                 offset=offset):
                for log in logs:
                    if log.id not in seen:
                        seen.add(log.id)
                        print(f"{log.timestamp:%H:%M:%S} | {log.name} - {log.message}", file=out, flush=True)
                    newest = max(newest or log.timestamp, log.timestamp)
                offset += len(logs)
            if state in FINAL:
                return state
            since = newest - timedelta(seconds=LATE_S) if newest else None
            await asyncio.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.logs <run> [--poll S]``: `follow` the run; exit status 0 when it Completed, 1 in another
    final state, 2 when there is no such run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="flow run id (printed by `prefect deployment run`) or name")
    parser.add_argument("--poll", type=float, default=2.0, help="seconds between polls (default 2)")
    args = parser.parse_args(argv)
    state = asyncio.run(follow(args.run, args.poll))
    if state is None:
        print(f"error: no flow run {args.run!r}", file=sys.stderr)
        return 2
    print(f"flow run {args.run}: {state}", file=sys.stderr)
    return 0 if state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
