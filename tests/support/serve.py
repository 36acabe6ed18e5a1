"""`python -m detpipe.serve` for tests and benchmarks: the real server as a subprocess on a free loopback port
(`running_server`), and the comparison of its answers with predict's (`results_differ`)."""
from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from support.procs import free_port, stage_env, stop_group


@dataclasses.dataclass
class Server:
    """A started server: its process (own session), base URL, log file (stdout and stderr), and the ``/readyz``
    statuses seen while it started (``None``: no connection yet), in order."""

    proc: subprocess.Popen
    url: str
    log: Path
    readyz_seen: list

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def wait_ready(server: Server, timeout_s: float = 300, poll_s: float = 0.01) -> None:
    """Poll ``GET /readyz`` until it answers 200 (the model loaded and warmed up), recording each status in
    ``server.readyz_seen``; fails with the log's tail when the process exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10) as client:
        while True:
            assert server.proc.poll() is None, (f"serve exited ({server.proc.returncode}) before it was ready:\n"
                                                f"{server.log_text()[-4000:]}")
            assert time.monotonic() < deadline, f"serve not ready after {timeout_s} s:\n{server.log_text()[-4000:]}"
            try:
                status = client.get(f"{server.url}/readyz").status_code
            except httpx.TransportError:
                status = None
            if not server.readyz_seen or server.readyz_seen[-1] != status:
                server.readyz_seen.append(status)
            if status == 200:
                return
            time.sleep(poll_s)


@contextlib.contextmanager
def running_server(model: Path, data: Path, log: Path, *options: str, cwd: Path | None = None,
                   timeout_s: float = 300) -> Iterator[Server]:
    """``python -m detpipe.serve --model MODEL --data DATA --port <free> OPTIONS`` started in its own session
    (output into ``log``), ready (`wait_ready`) when yielded; stopped afterwards with `support.procs.stop_group`
    (SIGTERM, then SIGKILL) unless it already exited."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "detpipe.serve", "--model", str(model), "--data", str(data),
                                 "--port", str(port), *options], cwd=cwd or log.parent, env=stage_env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log, [])
    try:
        wait_ready(server, timeout_s)
        yield server
    finally:
        if proc.poll() is None:
            stop_group(proc)


def results_differ(served: list[dict], offline: list[dict], atol_px: float = 1e-3,
                   atol_score: float = 1e-5) -> str | None:
    """Why one image's served COCO results differ from predict's for it, or None when they agree: the same
    number of detections, in the same order, each with the same ``image_id``, ``file_name``, ``category_id`` and
    ``category_name``, its ``bbox`` within ``atol_px`` pixels and its ``score`` within ``atol_score``. (A batch of
    several images rounds some floats differently from a batch of one: about 1e-9 on scores, 1e-4 px on boxes.)"""
    if len(served) != len(offline):
        return f"{len(served)} detections served, {len(offline)} offline"
    for n, (a, b) in enumerate(zip(served, offline)):
        for key in ("image_id", "file_name", "category_id", "category_name"):
            if a.get(key) != b.get(key):
                return f"detection {n}: {key} {a.get(key)!r} served, {b.get(key)!r} offline"
        if set(a) != set(b):
            return f"detection {n}: keys {sorted(a)} served, {sorted(b)} offline"
        if max(abs(x - y) for x, y in zip(a["bbox"], b["bbox"])) > atol_px:
            return f"detection {n}: bbox {a['bbox']} served, {b['bbox']} offline"
        if abs(a["score"] - b["score"]) > atol_score:
            return f"detection {n}: score {a['score']} served, {b['score']} offline"
    return None
