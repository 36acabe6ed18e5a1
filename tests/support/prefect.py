"""A real Prefect server for tests (SQLite in a temporary ``PREFECT_HOME``, analytics and UI off, on a free
loopback port) and CLI helpers bound to it; one server serves every Prefect test of a run (tests/conftest.py)."""
from __future__ import annotations

import contextlib
import json
import logging
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Iterator

from detpipe.orchestration.deployments import ZOMBIE_ENV
from support.procs import REPO, free_port, stage_env, stop_group

HEARTBEAT_S = 30       # Prefect's minimum
ZOMBIE_AFTER_S = 60    # crash detection in tests: two heartbeat intervals (the documented default is 90 s)


class Prefect:
    """A running Prefect server + ``python -m flows.serve``, and CLI helpers bound to them."""

    def __init__(self, env: dict, logs: Path):
        self.env, self.logs, self.procs = env, logs, []

    def serve(self, name: str = "main") -> subprocess.Popen:
        """Start ``python -m flows.serve --name <name> --limit 2`` (deployments ``train/<name>`` and
        ``sweep/<name>``, two runs at once) in its own session, logging to ``serve-<name>.log``; added to
        ``procs`` (whoever started it stops it)."""
        with open(self.logs / f"serve-{name}.log", "a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "flows.serve", "--name", name, "--limit", "2"],
                                    env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def serving(self, name: str = "main", timeout: float = 120) -> subprocess.Popen:
        """`serve` ``name`` and wait until deployment ``train/<name>`` exists."""
        proc = self.serve(name)
        deadline = time.monotonic() + timeout
        while not self.deployment_exists(f"train/{name}"):
            assert proc.poll() is None, (self.logs / f"serve-{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"deployment train/{name} not served in {timeout} s"
            time.sleep(1)
        return proc

    def cli(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "prefect", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, cwd=self.logs)
        if check:
            assert proc.returncode == 0, f"prefect {' '.join(args)}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def run_args(self, repo: Path, overrides: dict | None, name: str, deployment: str = "train/main") -> list[str]:
        params = {"repo": str(repo), "overrides": overrides}
        return [sys.executable, "-m", "prefect", "deployment", "run", deployment, "--params", json.dumps(params),
                "--flow-run-name", name, "--watch", "--watch-interval", "2"]

    def start_run(self, repo: Path, overrides: dict | None, name: str,
                  deployment: str = "train/main") -> subprocess.Popen:
        return subprocess.Popen(self.run_args(repo, overrides, name, deployment), env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self.logs)

    def run(self, repo: Path, overrides: dict | None, name: str, timeout: float = 600) -> tuple[int, str, str]:
        """``prefect deployment run train/main --watch``: (exit status, output, flow run id)."""
        proc = subprocess.run(self.run_args(repo, overrides, name), env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.logs)
        return proc.returncode, proc.stdout + proc.stderr, run_id(proc.stdout + proc.stderr)

    def api(self, method: str, path: str, body: dict | None = None):
        """One call of the server's REST API (``PREFECT_API_URL`` + ``path``) over HTTP: the decoded JSON answer.
        Polling through it costs no interpreter start (a ``prefect`` CLI call takes ~1.5 s of CPU), so waiting on a
        run does not slow the run down."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.env["PREFECT_API_URL"] + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read() or b"null")

    def flow_run(self, run: str) -> dict:
        """The flow run's record (what ``prefect flow-run inspect -o json`` prints): ``state.type``, times, name."""
        return self.api("GET", f"/flow_runs/{run}")

    def deployment_exists(self, name: str) -> bool:
        """Whether deployment ``flow/deployment`` is registered."""
        try:
            self.api("GET", f"/deployments/name/{name}")
            return True
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return False
            raise

    def wait_final(self, run: str, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.flow_run(run)
            if info["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return info
            time.sleep(2)
        raise AssertionError(f"flow run {run} still {info['state']['type']} after {timeout} s")

    def id_of(self, name: str) -> str:
        """The id of the flow run named ``name``."""
        runs = self.api("POST", "/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}, "limit": 1})
        assert runs, f"no flow run named {name!r}"
        return runs[0]["id"]

    def artifact(self, run: str, key: str) -> str:
        """The content of artifact ``key`` that flow run ``run`` published (its newest version; a table as JSON):
        looked up by run, so runs of other tests publishing the same key meanwhile do not matter."""
        found = self.api("POST", "/artifacts/filter", {"artifacts": {"key": {"any_": [key]},
                                                                     "flow_run_id": {"any_": [run]}},
                                                       "sort": "CREATED_DESC", "limit": 1})
        assert found, f"flow run {run} published no artifact {key!r}"
        data = found[0]["data"]
        return data if isinstance(data, str) else json.dumps(data)

    def logs_of(self, run: str) -> str:
        """The run's log as ``prefect flow-run logs`` prints it (``<UTC time> | <level> | Flow run '<name>' -
        <message>`` per record, oldest first)."""
        name, lines, offset = self.flow_run(run)["name"], [], 0
        while True:
            page = self.api("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run]}},
                                                      "sort": "TIMESTAMP_ASC", "offset": offset, "limit": 200})
            for log in page:
                stamp = datetime.fromisoformat(log["timestamp"].replace("Z", "+00:00"))
                lines.append(f"{stamp:%Y-%m-%d %H:%M:%S.%f}"[:-3] + f" | {logging.getLevelName(log['level']):7s} | "
                             f"Flow run {name!r} - {log['message']}")
            if len(page) < 200:
                return "\n".join(lines) + "\n"
            offset += len(page)

    def result(self, run: str) -> dict:
        """The flow run's persisted return value (read back through the API and result storage)."""
        code = ("import json, sys\nfrom prefect.client.orchestration import get_client\n"
                "with get_client(sync_client=True) as c:\n"
                "    print(json.dumps(c.read_flow_run(sys.argv[1]).state.result()))\n")
        proc = subprocess.run([sys.executable, "-c", code, run], env=self.env, capture_output=True, text=True,
                              timeout=120, cwd=self.logs)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])


def run_id(output: str) -> str:
    m = re.search(r"flow-run/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})", output)
    assert m, output
    return m.group(1)


@contextlib.contextmanager
def prefect_server(home: Path) -> Iterator[Prefect]:
    """``prefect server start --host 127.0.0.1`` on a free port (SQLite in ``home`` as PREFECT_HOME, analytics
    and UI off), healthy; yields a `Prefect` whose ``procs`` (the server first) are all stopped at the end."""
    port = free_port()
    env = stage_env({"PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
                     "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONDONTWRITEBYTECODE": "1",
                     "PREFECT_SERVER_UI_ENABLED": "false", "PREFECT_CLI_WRAP_LINES": "false",
                     "PREFECT_RUNNER_POLL_FREQUENCY": "2",  # serve picks new runs up within 2 s
                     "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
                     # the shortest safe crash detection: Prefect's minimum heartbeat interval (30 s) and two
                     # of them without a heartbeat before a run is Crashed (the default is three: 90 s)
                     "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S), ZOMBIE_ENV: str(ZOMBIE_AFTER_S)})
    p = Prefect(env, home)
    home.mkdir(parents=True, exist_ok=True)
    try:
        with open(home / "server.log", "w") as log:
            p.procs.append(subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host",
                                             "127.0.0.1", "--port", str(port)], env=env, cwd=home, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert p.procs[0].poll() is None, (home / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prefect server did not become healthy in 180 s"
            time.sleep(0.5)
        yield p
    finally:
        stop_group(p.procs)


