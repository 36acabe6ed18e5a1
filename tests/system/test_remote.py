"""DVC remotes (`.dvc/config`): the default local remote on a fresh clone, the S3 remote against a real SeaweedFS
server on 127.0.0.1 (push/pull round trip, `dvc exp push/pull`, resuming an interrupted training in another clone,
a push interrupted by a server restart), bounded errors for bad credentials and dead endpoints, credentials never
in committed files or output, and the train stage reading the augmentation cache straight from `s3://`.

Clone A runs the real pipeline (12 COCO128 images, tiny params) once per module (`s3_team`); the other clones get
everything through git (a bare repository) and the DVC remote only.
"""
from __future__ import annotations

import configparser
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from support.pipeline import checkpoint_iterations, set_params, write_params
from support.procs import REPO, stage_env
from support.procs import free_ports, run
from support.s3server import S3Server, log_tail, stop, weed_command, write_identities
from support.repos import clone_with_cache, copy_repo

# An error must come back well within this (the committed remote config bounds connect and read timeouts).
ERROR_BOUND_S = 60.0


def out_paths(repo: Path) -> list[str]:
    """Paths of the outputs in ``repo/dvc.yaml`` that DVC caches (pushes and pulls); ``cache: false`` ones (metrics,
    plots) are versioned in git instead."""
    paths = set()
    for stage in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"].values():
        for item in (stage.get("outs") or []) + (stage.get("metrics") or []) + (stage.get("plots") or []):
            path, opts = (item, {}) if isinstance(item, str) else next(iter(item.items()))
            if (opts or {}).get("cache", True):
                paths.add(path)
    return sorted(paths)


def file_hashes(repo: Path, paths: list[str]) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``paths`` (files or folders) in ``repo``."""
    result = {}
    for rel in paths:
        root = repo / rel
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            result[f.relative_to(repo).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return result


def assert_no_secret(secret: str, *texts: str) -> None:
    for text in texts:
        assert secret not in text, "the secret key appeared in output or a committed file"


def no_aws_files(tmp: Path) -> dict:
    """Environment that keeps a developer's ``~/.aws`` out of a test (credentials only from the test)."""
    return {"AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-credentials"), "AWS_CONFIG_FILE": str(tmp / "no-config")}


# --------------------------------------------------------------------------------------------------------------
# The committed configuration


def test_committed_remote_config():
    """`.dvc/config`: analytics off, a default remote that needs no setup, an S3 remote with bounded timeouts, and
    no credentials (they belong in the git-ignored `.dvc/config.local`, the environment or `~/.aws`)."""
    text = (REPO / ".dvc" / "config").read_text()
    cfg = configparser.ConfigParser()
    cfg.read_string(text)
    assert cfg["core"]["analytics"] == "false"
    default = cfg["core"]["remote"]
    local_url = cfg[f"'remote \"{default}\"'"]["url"]
    assert "://" not in local_url and not os.path.isabs(local_url)
    resolved = (REPO / ".dvc" / local_url).resolve()
    assert not resolved.is_relative_to(REPO.resolve()), "the local remote must live outside the working tree"
    s3 = cfg["'remote \"s3\"'"]
    assert s3["url"].startswith("s3://")
    assert 0 < int(s3["connect_timeout"]) <= 30 and 0 < int(s3["read_timeout"]) <= 120
    for section in cfg.sections():
        for key in ("access_key_id", "secret_access_key", "session_token", "password", "credentialpath"):
            assert key not in cfg[section], f".dvc/config [{section}] has '{key}': credentials must not be committed"
    assert "/config.local" in (REPO / ".dvc" / ".gitignore").read_text().split()


def test_default_local_remote_on_fresh_clone(tmp_path):
    """`dvc push` / `dvc pull` with no remote setup: the default remote is a folder beside the clone."""
    a = copy_repo(tmp_path / "A")
    write_params(a, {"download": {"sha256": None}})   # the committed sha256 pins the full COCO128
    run(["dvc", "repro", "download"], a)
    run(["git", "add", "-A"], a)
    run(["git", "commit", "-qm", "download"], a)
    push = run(["dvc", "push"], a)
    assert "pushed" in push.stdout
    assert (tmp_path / "dvc-storage" / "files" / "md5").is_dir()        # ../dvc-storage next to the clone

    b = tmp_path / "B"
    run(["git", "clone", "-q", str(a), str(b)], tmp_path)
    run(["dvc", "pull", "download"], b)           # only download has run: the other stages have no data yet
    assert file_hashes(b, ["data/raw"]) == file_hashes(a, ["data/raw"])
    assert len(file_hashes(b, ["data/raw"])) == 13                       # 12 images + the annotations
    status = run(["dvc", "status", "download"], b)
    assert "up to date" in status.stdout


# --------------------------------------------------------------------------------------------------------------
# The team round trip on S3


@dataclass
class S3Team:
    a: Path                 # clone A: ran the pipeline and pushed
    origin: Path            # bare git repository the clones share
    bucket: str
    env: dict               # AWS_* credentials for DVC subprocesses
    secret: str
    work: Path


@pytest.fixture(scope="module")
def s3_team(tmp_path_factory, s3_server, reproduced_repo) -> S3Team:
    """Clone A configured as the README says (S3 remote with `endpointurl`, made the default, committed; the
    credentials only in the environment), where `dvc repro` of the whole pipeline has run (a copy of the session's
    ``reproduced_repo``: `dvc repro` finds it up to date), after `git push` and `dvc push`."""
    work = tmp_path_factory.mktemp("s3_team")
    origin = work / "origin.git"
    run(["git", "init", "-q", "--bare", "-b", "main", str(origin)], work)
    a = clone_with_cache(reproduced_repo, work / "A")
    bucket = s3_server.create_bucket()
    env = {**s3_server.env(), **no_aws_files(work)}
    run(["dvc", "remote", "modify", "s3", "url", f"s3://{bucket}/dvc"], a)
    run(["dvc", "remote", "modify", "s3", "endpointurl", s3_server.endpoint_url], a)
    run(["dvc", "remote", "default", "s3"], a)
    run(["git", "commit", "-qam", "S3 remote"], a)
    run(["git", "remote", "add", "origin", str(origin)], a)
    repro = run(["dvc", "repro"], a, env=env)
    assert "Data and pipelines are up to date." in repro.stdout + repro.stderr
    assert run(["git", "status", "--porcelain"], a).stdout == ""
    run(["git", "push", "-q", "origin", "main"], a)
    push = run(["dvc", "push"], a, env=env)
    assert re.search(r"\d+ files? pushed", push.stdout), push.stdout
    assert_no_secret(s3_server.secret_key, push.stdout, push.stderr, (a / ".dvc" / "config").read_text())
    return S3Team(a=a, origin=origin, bucket=bucket, env=env, secret=s3_server.secret_key, work=work)


def clone(s3_team: S3Team, name: str, branch: str = "main") -> Path:
    dest = s3_team.work / name
    run(["git", "clone", "-q", "-b", branch, str(s3_team.origin), str(dest)], s3_team.work)
    return dest


@pytest.mark.slow
def test_s3_round_trip_fresh_clone_is_up_to_date(s3_team):
    """Fresh clone B: `dvc pull` restores every cached output byte for byte, and `dvc repro` has nothing to do."""
    b = clone(s3_team, "B")
    tracked = run(["git", "ls-files", "-z"], b).stdout.split("\0")
    for rel in filter(None, tracked):
        if (b / rel).is_file():
            assert_no_secret(s3_team.secret, (b / rel).read_text(errors="replace"))
    pull = run(["dvc", "pull"], b, env=s3_team.env)
    assert_no_secret(s3_team.secret, pull.stdout, pull.stderr)
    paths = out_paths(s3_team.a)
    assert {"data/raw", "data/arrow", "data/cache", "models/model.pt", "checkpoints", "models/model.onnx",
            "models/torch_export"} <= set(paths)
    expected = file_hashes(s3_team.a, paths)
    assert file_hashes(b, paths) == expected
    assert any(p.startswith("checkpoints/ckpt-") for p in expected)
    # metrics are `cache: false` outputs: versioned in git with dvc.lock, so the clone has them already
    assert (b / "metrics" / "eval.json").read_bytes() == (s3_team.a / "metrics" / "eval.json").read_bytes()
    repro = run(["dvc", "repro"], b, env=s3_team.env)
    assert "Data and pipelines are up to date." in repro.stdout + repro.stderr
    assert run(["git", "status", "--porcelain"], b).stdout == ""


@pytest.mark.slow
def test_exp_push_and_pull(s3_team):
    """An experiment run in clone E, `dvc exp push origin <exp>` (git ref + DVC data), `dvc exp pull` and
    `dvc exp apply` in clone C that has pulled nothing else: same params, metrics and data."""
    e = clone(s3_team, "E")
    run(["dvc", "pull"], e, env=s3_team.env)
    exp = run(["dvc", "exp", "run", "-S", "evaluate.score_threshold=0.05", "-S", "export.torch_export=false",
               "--name", "thr05"], e, env=s3_team.env)   # ONNX only: torch.export is tested in test_export
    assert "Running stage 'evaluate'" in exp.stdout and "Running stage 'train'" not in exp.stdout
    e_metrics = json.loads((e / "metrics" / "eval.json").read_text())
    push = run(["dvc", "exp", "push", "origin", "thr05"], e, env=s3_team.env)
    assert_no_secret(s3_team.secret, push.stdout, push.stderr)

    c = clone(s3_team, "C")
    assert "thr05" not in run(["dvc", "exp", "list", "--name-only"], c).stdout.split()
    pull = run(["dvc", "exp", "pull", "origin", "thr05"], c, env=s3_team.env)
    assert_no_secret(s3_team.secret, pull.stdout, pull.stderr)
    assert "thr05" in run(["dvc", "exp", "list", "--name-only"], c).stdout.split()
    run(["dvc", "exp", "apply", "thr05"], c, env=s3_team.env)
    assert yaml.safe_load((c / "params.yaml").read_text())["evaluate"]["score_threshold"] == 0.05
    assert json.loads((c / "metrics" / "eval.json").read_text()) == e_metrics
    paths = out_paths(c)
    assert file_hashes(c, paths) == file_hashes(e, paths)               # the experiment's data came along


def _wait_for_checkpoint(proc: subprocess.Popen, work: Path, after: int, timeout: float) -> None:
    """Wait until ``work/checkpoints`` has a checkpoint of an iteration greater than ``after``."""
    deadline = time.monotonic() + timeout
    while not any(i > after for i in checkpoint_iterations(work)):
        assert proc.poll() is None, f"training ended early:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint after iteration {after} in {timeout} s"
        time.sleep(0.1)


@pytest.mark.slow
def test_interrupted_training_resumes_in_another_clone(s3_team):
    """A's training is killed after a checkpoint; `python -m detpipe.orchestration.commit_partial train` + `dvc push` share the
    checkpoints; clone B2 pulls them and `dvc repro` resumes where A stopped."""
    a2 = clone(s3_team, "A2")
    run(["dvc", "pull"], a2, env=s3_team.env)
    run(["git", "checkout", "-q", "-b", "long-run"], a2)
    set_params(a2, {"train": {"epochs": 4, "checkpoint_every": 1}})
    run(["git", "commit", "-qam", "longer training"], a2)

    pulled = checkpoint_iterations(a2)                                      # the finished 1-epoch run's (other params)
    env = {**stage_env(), "DVC_NO_ANALYTICS": "1", **s3_team.env}
    proc = subprocess.Popen(["dvc", "repro"], cwd=a2, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        _wait_for_checkpoint(proc, a2, after=max(pulled), timeout=300)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)                             # the whole job: dvc, torchrun, workers
        proc.wait()
    assert not (a2 / "models" / "model.pt").exists()
    newest = max(checkpoint_iterations(a2))
    assert max(pulled) < newest < 8

    partial = run([sys.executable, "-m", "detpipe.orchestration.commit_partial", "train"], a2)
    assert "recorded checkpoints" in partial.stdout and "models/model.pt" in partial.stdout
    status = run(["dvc", "status", "train"], a2).stdout
    assert "models/model.pt" in status                                  # the stage is not up to date
    run(["git", "add", "-A"], a2)
    run(["git", "commit", "-qm", "partial training"], a2)
    run(["git", "push", "-q", "origin", "long-run"], a2)
    run(["dvc", "push"], a2, env=s3_team.env)
    shared = file_hashes(a2, ["checkpoints"])

    b2 = clone(s3_team, "B2", branch="long-run")
    run(["dvc", "pull", "--allow-missing"], b2, env=s3_team.env)       # model.pt has no hash yet
    assert file_hashes(b2, ["checkpoints"]) == shared
    assert not (b2 / "models" / "model.pt").exists()
    repro = run(["dvc", "repro", "train"], b2, env=s3_team.env)
    log = repro.stdout + repro.stderr
    assert f"resuming from checkpoints/ckpt-{newest:07d}.pt (iteration {newest})" in log, log[-3000:]
    assert "wrote models/model.pt after 8 iterations" in log            # 4 epochs x 2 iterations (9 images)


# --------------------------------------------------------------------------------------------------------------
# Faults


class RestartableS3:
    """`weed mini` as in `s3server.running_s3_server`, but stoppable and restartable on the same ports, data
    folder and credentials (a real server restart, not a new empty one)."""

    def __init__(self, workdir: Path):
        self.workdir, self.data = workdir, workdir / "data"
        self.data.mkdir(parents=True)
        self.access_key, self.secret_key, self.config = write_identities(workdir)
        self.ports = free_ports(10)
        self.server = S3Server(endpoint_url=f"http://127.0.0.1:{self.ports[6]}", access_key=self.access_key,
                               secret_key=self.secret_key, workdir=workdir)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 30.0) -> None:
        cmd = weed_command(self.data, "127.0.0.1", self.ports, self.config, self.workdir)
        self.log = self.workdir / f"weed{self.starts}.log"
        self.starts += 1
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(cmd, cwd=self.data, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline, error = time.monotonic() + timeout, ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                fs = self.server.filesystem()
                fs.pipe("probe/ok", b"ok")
                if fs.cat("probe/ok") == b"ok":
                    return
            except Exception as e:                                      # noqa: BLE001 - not up yet
                error = f"{type(e).__name__}: {e}"
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini not ready ({error})\n{log_tail(self.log)}")

    def freeze(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGCONT)            # a frozen server must run to stop
            stop(self.proc)
            self.proc = None


@pytest.fixture
def restartable_s3(tmp_path):
    server = RestartableS3(tmp_path / "weed")
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_push_interrupted_by_server_restart(s3_team, restartable_s3, tmp_path):
    """The server stops in the middle of `dvc push`: the push fails with an error; after a restart, pushing
    again completes, and a pull into a fresh clone restores every file (sha256 checked)."""
    s3 = restartable_s3
    fs = s3.server.filesystem()
    fs.mkdir("fault")
    env = {**s3.server.env(), **no_aws_files(tmp_path)}
    # a copy of A with 300 more small files in its DVC cache (`dvc add`, not committed): the upload is under way
    # for seconds, so the server can be stopped while files are still to go, whatever the machine's speed
    a = clone_with_cache(s3_team.a, tmp_path / "A")
    bulk = a / "bulk"
    bulk.mkdir()
    for i in range(300):
        (bulk / f"{i:03d}.bin").write_bytes(os.urandom(16384))
    run(["dvc", "add", "bulk"], a)
    # a second S3 remote, only in A's git-ignored local config
    run(["dvc", "remote", "add", "--local", "-f", "fault", "s3://fault/dvc"], a)
    run(["dvc", "remote", "modify", "--local", "fault", "endpointurl", s3.server.endpoint_url], a)

    # AWS_MAX_ATTEMPTS=1: once the server is gone each remaining upload fails at once instead of after botocore's
    # retries (~6 s each), which keeps this test short; the retries are not what is tested here.
    full_env = {**stage_env(), "DVC_NO_ANALYTICS": "1", **env, "AWS_MAX_ATTEMPTS": "1"}
    push = subprocess.Popen(["dvc", "push", "-r", "fault", "-j", "1"], cwd=a, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.append(push.stdout.read()), daemon=True)
    reader.start()
    uploaded, deadline = 0, time.monotonic() + 120
    while uploaded < 2:                                                 # wait for the upload to be under way
        assert push.poll() is None, f"push ended before it could be interrupted:\n{''.join(output)}"
        assert time.monotonic() < deadline, "push uploaded nothing in 120 s"
        uploaded = len(s3.server.filesystem().find("fault/dvc"))
        time.sleep(0.02)
    s3.freeze()                                                         # no more progress from here
    s3.stop()                                                           # then a normal shutdown (SIGTERM)
    started = time.monotonic()
    rc = push.wait(timeout=300)
    reader.join(10)
    failed_after = time.monotonic() - started
    text = "".join(output)
    assert rc != 0, f"push did not notice the server going away:\n{text}"
    assert "ERROR" in text and failed_after < ERROR_BOUND_S, (failed_after, text[-2000:])

    s3.start()                                                          # same ports, data and credentials
    before = len(s3.server.filesystem().find("fault/dvc"))
    assert before >= uploaded                                           # what was uploaded survived the restart
    again = run(["dvc", "push", "-r", "fault"], a, env=env)
    assert re.search(r"\d+ files? pushed", again.stdout), again.stdout
    assert len(s3.server.filesystem().find("fault/dvc")) > before
    synced = run(["dvc", "status", "--cloud", "-r", "fault"], a, env=env)
    assert "in sync" in synced.stdout, synced.stdout

    d = clone(s3_team, f"D-{tmp_path.name}")
    run(["dvc", "remote", "add", "--local", "fault", "s3://fault/dvc"], d)
    run(["dvc", "remote", "modify", "--local", "fault", "endpointurl", s3.server.endpoint_url], d)
    pull = run(["dvc", "pull", "-r", "fault"], d, env=env)
    assert_no_secret(s3.secret_key, pull.stdout, pull.stderr, text, again.stdout, again.stderr)
    paths = out_paths(a)
    assert file_hashes(d, paths) == file_hashes(a, paths)
    run(["dvc", "remote", "remove", "--local", "fault"], a)


@pytest.fixture
def tiny_dvc_repo(tmp_path) -> Path:
    """A git + DVC repository with the committed `.dvc/config` and one tracked file (nothing pushed yet)."""
    repo = tmp_path / "tiny"
    repo.mkdir()
    run(["git", "init", "-q", "-b", "main"], repo)
    run(["dvc", "init", "-q"], repo)
    shutil.copyfile(REPO / ".dvc" / "config", repo / ".dvc" / "config")
    (repo / "blob.bin").write_bytes(os.urandom(4096))
    run(["dvc", "add", "-q", "blob.bin"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "tiny"], repo)
    return repo


def timed_push(repo: Path, env: dict, drop: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = run(["dvc", "push", "-r", "s3"], repo, env=env, check=False, timeout=600, drop=drop)
    print(f"dvc push: exit {proc.returncode} after {time.monotonic() - started:.1f} s")
    return proc, time.monotonic() - started


@pytest.mark.slow
def test_bad_credentials_and_dead_endpoints_fail_fast(s3_server, tiny_dvc_repo, tmp_path):
    """Wrong secret, no credentials, a closed port, and a server that accepts connections but never answers:
    each is a one-line DVC error within `ERROR_BOUND_S`, with no secret in the output. Right credentials in
    `.dvc/config.local` (`dvc remote modify --local`) work and stay out of git."""
    repo = tiny_dvc_repo
    bucket = s3_server.create_bucket()
    run(["dvc", "remote", "modify", "s3", "url", f"s3://{bucket}/dvc"], repo)
    run(["dvc", "remote", "modify", "s3", "endpointurl", s3_server.endpoint_url], repo)
    run(["git", "commit", "-qam", "S3 remote"], repo)
    good = {**s3_server.env(), **no_aws_files(tmp_path)}

    wrong_secret = secrets.token_hex(20)
    proc, took = timed_push(repo, {**good, "AWS_SECRET_ACCESS_KEY": wrong_secret})
    assert proc.returncode != 0 and took < ERROR_BOUND_S, (took, proc.stderr)
    assert re.search(r"SignatureDoesNotMatch|Forbidden|AccessDenied", proc.stderr), proc.stderr
    assert_no_secret(wrong_secret, proc.stdout, proc.stderr)

    proc, took = timed_push(repo, no_aws_files(tmp_path), drop=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                                 "AWS_SESSION_TOKEN", "AWS_PROFILE"))
    assert proc.returncode != 0 and took < ERROR_BOUND_S, (took, proc.stderr)
    assert "Unable to locate credentials" in proc.stderr, proc.stderr

    closed = free_ports(1)[0]                                          # nothing listens there
    run(["dvc", "remote", "modify", "--local", "s3", "endpointurl", f"http://127.0.0.1:{closed}"], repo)
    proc, took = timed_push(repo, good)
    assert proc.returncode != 0 and took < ERROR_BOUND_S, (took, proc.stderr)
    assert "Could not connect to the endpoint URL" in proc.stderr, proc.stderr

    # A real TCP listener that never answers: bounded by read_timeout x attempts (botocore AWS_MAX_ATTEMPTS,
    # s3fs's own 5 retries), here read_timeout 2 s and one botocore attempt.
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        port = silent.getsockname()[1]
        run(["dvc", "remote", "modify", "--local", "s3", "endpointurl", f"http://127.0.0.1:{port}"], repo)
        run(["dvc", "remote", "modify", "--local", "s3", "read_timeout", "2"], repo)
        proc, took = timed_push(repo, {**good, "AWS_MAX_ATTEMPTS": "1"})
    finally:
        silent.close()
    assert proc.returncode != 0 and took < ERROR_BOUND_S, (took, proc.stderr)
    assert "Read timeout" in proc.stderr, proc.stderr

    # the right credentials, kept in .dvc/config.local
    (repo / ".dvc" / "config.local").unlink()
    run(["dvc", "remote", "modify", "--local", "s3", "access_key_id", s3_server.access_key], repo)
    run(["dvc", "remote", "modify", "--local", "s3", "secret_access_key", s3_server.secret_key], repo)
    proc, took = timed_push(repo, no_aws_files(tmp_path), drop=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    assert proc.returncode == 0, proc.stderr
    assert "1 file pushed" in proc.stdout
    verbose = run(["dvc", "pull", "-v", "-r", "s3", "--force"], repo, env=no_aws_files(tmp_path),
                  drop=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    assert_no_secret(s3_server.secret_key, proc.stdout, proc.stderr, verbose.stdout, verbose.stderr,
                     (repo / ".dvc" / "config").read_text())
    assert run(["git", "status", "--porcelain"], repo).stdout == ""    # config.local is git-ignored


# --------------------------------------------------------------------------------------------------------------
# Multi-node reading: train straight from the bucket


def cache_url(server: S3Server, bucket: str) -> str:
    host = server.endpoint_url.split("://", 1)[1]
    return f"s3://{bucket}/cache?endpoint_override={host}&scheme=http"


@pytest.mark.slow
def test_train_reads_cache_from_s3(s3_server, cached_workdir, trained_workdir, tmp_path):
    """`train.cache_url` pointing at a bucket holding the augment stage's cache, no `data/cache` locally: training
    runs and gives bit-for-bit the weights of the same training from the local cache."""
    bucket = s3_server.create_bucket()
    s3_server.filesystem().put(str(cached_workdir / "data" / "cache"), f"{bucket}/cache", recursive=True)
    work = tmp_path / "node"
    (work / "data").mkdir(parents=True)
    shutil.copytree(cached_workdir / "data" / "arrow", work / "data" / "arrow")
    write_params(work, {"train": {"cache_url": cache_url(s3_server, bucket)}})
    env = {**s3_server.env(), **no_aws_files(tmp_path)}
    proc = run([sys.executable, "-m", "stages.train"], work, env=env, timeout=600)
    assert not (work / "data" / "cache").exists()
    assert_no_secret(s3_server.secret_key, proc.stdout, proc.stderr)
    remote = torch.load(work / "models" / "model.pt", map_location="cpu", weights_only=False)["model"]
    local = torch.load(trained_workdir / "models" / "model.pt", map_location="cpu", weights_only=False)["model"]
    assert remote.keys() == local.keys()
    assert all(torch.equal(remote[k], local[k]) for k in local), "weights differ from the local-cache run"

    # wrong credentials: a one-line stage error naming the URL, quickly, without the secret
    wrong = secrets.token_hex(20)
    started = time.monotonic()
    bad = run([sys.executable, "-m", "stages.train"], work, env={**env, "AWS_SECRET_ACCESS_KEY": wrong},
              check=False, timeout=300)
    assert bad.returncode == 2 and time.monotonic() - started < ERROR_BOUND_S, bad.stderr[-2000:]
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("error: train.cache_url:") and f"s3://{bucket}/cache" in last, last
    assert_no_secret(wrong, bad.stdout, bad.stderr)
