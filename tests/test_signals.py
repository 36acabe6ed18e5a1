"""SIGTERM/SIGINT to a stage other than train: one `error:` line naming the signal and the stage, exit status
128 + signal, no traceback, no partial output (train's case is in test_train.py)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

import pytest

from support.pipeline import write_params
from support.procs import stage_env


@pytest.fixture
def stalling_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers; ``accepted`` is set on the first."""
    srv = socket.create_server(("127.0.0.1", 0))
    accepted, conns = threading.Event(), []

    def serve():
        while True:
            try:
                conns.append(srv.accept()[0])
            except OSError:
                return
            accepted.set()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}", accepted
    srv.close()
    for c in conns:
        c.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_download_interrupted_mid_fetch(tmp_path, stalling_server, sig):
    url, accepted = stalling_server
    write_params(tmp_path, {"download": {"source": f"{url}/coco.zip", "timeout_s": 120, "retries": 0}})
    proc = subprocess.Popen([sys.executable, "-m", "stages.download"], cwd=tmp_path, env=stage_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert accepted.wait(120), "the stage never connected"  # it is inside main(), waiting for the server
    proc.send_signal(sig)
    stderr = proc.communicate(timeout=60)[1]
    assert proc.returncode == 128 + sig, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: interrupted by {sig.name} in stage download"], stderr[-2000:]
    raw = tmp_path / "data" / "raw"
    assert not raw.exists() or not any(raw.iterdir())  # nothing half-fetched left behind
