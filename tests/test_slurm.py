"""The train stage under a real Slurm (munged + slurmctld + slurmd from Debian's packages, started here):
``train.launcher: slurm`` submits the ``--emit slurm`` script, streams the job's log, waits, and its weights
equal a local torchrun run; SIGTERM to the stage cancels the job. 1 node x 2 tasks = two torchrun agents
(see tests/slurm_cluster.py for why not two slurmd)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from support.pipeline import elastic_workdir
from support.procs import stage_env
from support.slurm_cluster import slurm_available, slurm_cluster
from support.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.skipif(slurm_available() is not None, reason=str(slurm_available()))]


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield {**stage_env(), "SLURM_CONF": env["SLURM_CONF"]}


def _params(port: int, **extra) -> dict:
    # two agents ("nodes") of 1 worker each as two tasks on the one Slurm node
    return {"launcher": "slurm", "nnodes": 2, "slurm_tasks_per_node": 2, "nproc_per_node": 1,
            "rdzv_endpoint": f"127.0.0.1:{port}", **extra}


def _squeue(env: dict) -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], env=env, capture_output=True, text=True).stdout


def test_slurm_job_streams_log_and_equals_local_run(cached_workdir, tmp_path, slurm_env, two_rank_workdir):
    work = elastic_workdir(cached_workdir, tmp_path / "w", _params(free_port()))
    emitted = subprocess.run([sys.executable, "-m", "stages.train", "--emit", "slurm"], cwd=work, env=slurm_env,
                             capture_output=True, text=True, check=True).stdout
    assert "#SBATCH --nodes=1\n" in emitted and "#SBATCH --ntasks-per-node=2\n" in emitted
    assert "#SBATCH --requeue" in emitted and f"--output={work.resolve()}/logs/slurm-%j.out" in emitted
    proc = subprocess.run([sys.executable, "-m", "stages.train"], cwd=work, env=slurm_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    # the submitted script is the emitted one; the job's log went to stdout as it grew
    assert (work / "logs/train.sbatch").read_text() == emitted
    (log,) = (work / "logs").glob("slurm-*.out")
    assert "rank 0 final weights digest" in proc.stdout and proc.stdout.strip() in log.read_text()
    assert "rank 0/2" in proc.stdout and "rank 1/2" in proc.stdout  # two agents, one worker each
    a = torch.load(work / "models/model.pt", weights_only=True)
    b = torch.load(two_rank_workdir / "models/model.pt", weights_only=True)
    assert a["iters"] == b["iters"] == 4
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_sigterm_cancels_the_slurm_job(cached_workdir, tmp_path, slurm_env):
    work = elastic_workdir(cached_workdir, tmp_path / "w", _params(free_port(), epochs=200))
    out = tmp_path / "stage.out"
    stage = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=work, env=slurm_env,
                             stdout=open(out, "wb"), stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not (work / "checkpoints/ckpt-0000001.pt").exists():  # the job is running and training
        assert stage.poll() is None and time.time() < deadline, out.read_text()[-3000:]
        time.sleep(0.2)
    job = (work / "logs/train.sbatch").exists() and next((work / "logs").glob("slurm-*.out")).stem.split("-")[1]
    assert f"{job} RUNNING" in _squeue(slurm_env)
    stage.send_signal(signal.SIGTERM)
    assert stage.wait(timeout=180) == 128 + signal.SIGTERM
    text = out.read_text()
    assert f"SIGTERM: cancelling slurm job {job}" in text and "error: interrupted by SIGTERM" in text
    assert job not in _squeue(slurm_env)  # gone from the queue when the stage returns
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and
                "torch.distributed.run" in p.info["cmdline"] and _cwd(p) == work.resolve()]
    assert not (work / "models/model.pt").exists()


def _cwd(p: psutil.Process) -> Path | None:
    try:
        return Path(p.cwd())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
