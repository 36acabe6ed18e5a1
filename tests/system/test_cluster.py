"""Training across hosts of a real (small) cluster: network namespaces on a bridge (tests/support/netns_cluster.py),
each with its own address in 198.18.0.0/15 and hostname; Slurm (``slurmctld`` on ``ctl``, a ``slurmd`` on each of
``c1`` ``c2`` ``c3``), the augmentation cache streamed from the SeaweedFS S3 server on ``st``
(``train.cache_url``), checkpoints on the shared filesystem (the hosts share this machine's files, as NFS would).

What a user does on a real cluster, and the faults real clusters have: the same training started with plain
torchrun on two hosts and submitted through Slurm (``train.launcher: slurm``) ends with the same weights, bit
for bit, as a 2-rank run on one machine; a host's processes SIGKILLed (elastic: the job goes on without it,
every sample once per epoch), a cut link (no TCP reset: the collective timeout turns the hang into a restart,
the log names the lost host), a Slurm node set DOWN (the job is requeued and resumes from its checkpoints), the
stage stopped (the job is cancelled, ``squeue`` empty).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import netns_cluster
from support.netns_cluster import slurm_available, squeue, wait_idle
from support.pipeline import elastic_workdir
from support.procs import stage_env
from support.s3server import running_s3_server

_why_not = netns_cluster.netns_available() or slurm_available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why_not is not None, reason=str(_why_not))]

PORT = 29400          # the rendezvous port (each host has its own network stack: no clash with this machine's)
IFNAME = "eth0"       # the hosts' cluster interface (train.socket_ifname)
RECOVERY_S = 60       # a fault must have been turned into a resumed training within this many seconds


class Cluster:
    """The module's cluster: `hosts` (`support.netns_cluster.Cluster`), `slurm` (environment of the Slurm
    commands), `s3` (the server on ``st``), `cache_url` (the cache uploaded there), `data` (a workdir's data/
    without its cache)."""

    def __init__(self, hosts, slurm, s3, cache_url, data):
        self.hosts, self.slurm, self.s3, self.cache_url, self.data = hosts, slurm, s3, cache_url, data

    def workdir(self, dest: Path, **train) -> Path:
        """A run folder reading the cache from ``st``, with `support.pipeline.ELASTIC_TRAIN` params + ``train``."""
        work = elastic_workdir(self.data, dest, {"cache_url": self.cache_url, "socket_ifname": IFNAME,
                                                 "rdzv_endpoint": f"{self.hosts.addr('c1')}:{PORT}", **train})
        return work

    def env(self, extra: dict | None = None) -> dict:
        return stage_env({**self.s3.env(), "SLURM_CONF": self.slurm["SLURM_CONF"], **(extra or {})})

    def start(self, host: str, work: Path, log: Path, extra: dict | None = None) -> subprocess.Popen:
        """``python -m stages.train`` in ``work`` on ``host``, output to ``log``."""
        return self.hosts.popen(host, [sys.executable, "-m", "stages.train"], cwd=work, env=self.env(extra),
                                stdout=open(log, "ab"), stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, cached_workdir):
    root = tmp_path_factory.mktemp("cluster")
    data = root / "data-only"
    shutil.copytree(cached_workdir / "data", data / "data", ignore=shutil.ignore_patterns("cache"))
    # the loader reads the cache's meta.json next to the shards: the cache goes to the bucket whole
    with netns_cluster.network(["ctl", "c1", "c2", "c3", "st"]) as hosts, \
            netns_cluster.slurm(hosts, root / "slurm", ["c1", "c2", "c3"]) as slurm, \
            running_s3_server(root / "s3", host=hosts.addr("st"),
                              popen=lambda cmd, **kw: hosts.popen("st", cmd, **kw)) as s3:
        bucket = s3.create_bucket()
        s3.filesystem().put(str(cached_workdir / "data/cache"), f"{bucket}/cache", recursive=True)
        port = s3.endpoint_url.rsplit(":", 1)[1]
        url = f"s3://{bucket}/cache?endpoint_override={hosts.addr('st')}:{port}&scheme=http"
        yield Cluster(hosts, slurm, s3, url, data)
    # nothing left behind: the hosts' namespaces (with their interfaces and the bridge) and this side's veth
    assert not [ns for ns in netns_cluster.namespaces() if ns.startswith(f"{hosts.tag}-")]
    assert hosts.root_if not in subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout


def _wait_for(check, procs: list[subprocess.Popen], what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert all(p.poll() is None for p in procs), f"training ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def _finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 300) -> list[str]:
    for p in procs:
        p.wait(timeout=timeout)
    texts = [log.read_text(errors="replace") for log in logs]
    for p, text in zip(procs, texts):
        assert p.returncode == 0, text[-4000:]
    return texts


def _same_weights(a_dir: Path, b_dir: Path) -> int:
    a = torch.load(a_dir / "models/model.pt", weights_only=True)
    b = torch.load(b_dir / "models/model.pt", weights_only=True)
    assert a["iters"] == b["iters"]
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    return a["iters"]


def _log_time(text: str, pattern: str) -> float:
    """The time (seconds since the epoch, this machine's clock) of the first log line matching ``pattern``."""
    m = re.search(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) .*{pattern}", text, re.M)
    assert m, f"no log line matching {pattern!r}"
    return time.mktime(time.strptime(m.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + int(m.group(1)[20:]) / 1000


def test_two_hosts_by_hand_and_through_slurm_train_bit_identical(cluster, tmp_path, two_rank_workdir):
    """2 nodes as a user starts them on two machines (plain torchrun: ``python -m stages.train`` on c1 and c2,
    ``nnodes: 2``, the endpoint at c1's address), and the same params submitted through Slurm from the login
    host (``launcher: slurm``): the rendezvous store listens on c1's cluster address only (not 0.0.0.0, not
    127.0.0.1), gloo runs on eth0, the cache streams from the storage host, and both end with weights equal bit
    for bit to each other and to the 2-rank run on one machine with the cache on disk."""
    hosts = cluster.hosts
    work = cluster.workdir(tmp_path / "plain", nnodes=2)
    logs = [tmp_path / "c1.log", tmp_path / "c2.log"]
    procs = [cluster.start("c1", work, logs[0]), cluster.start("c2", work, logs[1])]
    listening: list[str] = []

    def store_up() -> bool:
        listening[:] = [l for l in hosts.listening("c1") if l.split()[0].endswith(f":{PORT}")]
        return bool(listening)

    _wait_for(store_up, procs, "rendezvous store on c1")
    assert [l.split()[0] for l in listening] == [f"{hosts.addr('c1')}:{PORT}"], listening
    assert not [l for l in hosts.listening("c2") if l.split()[0].endswith(f":{PORT}")]
    texts = _finish(procs, logs)
    assert "rank 0/2" in "".join(texts) and "rank 1/2" in "".join(texts)
    assert f"--local-addr {hosts.addr('c1')}" in texts[0] and "is_host=true" in texts[0]
    assert f"--local-addr {hosts.addr('c2')}" in texts[1] and "is_host=false" in texts[1]
    assert not (work / "data/cache").exists()  # streamed from st, never copied into the run folder
    assert _same_weights(work, two_rank_workdir) == 4

    slurm = cluster.workdir(tmp_path / "slurm", nnodes=2, launcher="slurm",
                            rdzv_endpoint=f"anything:{PORT}")          # under Slurm only the port is used
    proc = hosts.run("ctl", [sys.executable, "-m", "stages.train"], cwd=slurm, env=cluster.env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"slurm job \d+ \(start 1\) on c\[1-2\], rendezvous on " + re.escape(hosts.addr("c1")),
                     proc.stdout), proc.stdout[-2000:]
    assert "rank 0/2" in proc.stdout and "rank 1/2" in proc.stdout
    assert _same_weights(slurm, two_rank_workdir) == 4
    assert not squeue(cluster.slurm).strip()


def _samples_once(samples: Path, text: str) -> None:
    """Every sample of the interrupted epoch trained on exactly once (ranks' sample logs: `DETPIPE_SAMPLE_LOG`),
    the epochs after it whole at world size 1 (the 9-image split: 8 per epoch at 2 images x 1 or 2 ranks)."""
    resumed = re.findall(r"resuming from .*\(iteration (\d+)\)", text)
    assert len(resumed) == 1, "expected one restart: " + str(resumed)
    at = int(resumed[0])
    rows = [json.loads(l) for f in samples.glob("*.jsonl") for l in f.read_text().splitlines()]
    trained = [r for r in rows if (r["world_size"] == 2 and r["iter"] < at) or r["world_size"] == 1]
    for epoch in sorted({r["epoch"] for r in trained}):
        ids = [i for r in trained if r["epoch"] == epoch for i in r["image_ids"]]
        assert len(ids) == len(set(ids)) == 8, (epoch, sorted(ids))


def test_killed_host_the_job_goes_on_without_it(cluster, tmp_path):
    """``nnodes: 1:2`` on c1 and c2; every process of c2 SIGKILLed after the first checkpoint (the machine lost its
    power; its sockets are reset by nobody): torchrun's elastic restart (not Slurm's: plain torchrun here) goes
    on with c1 alone from the newest checkpoint within `RECOVERY_S`, and every sample is trained on once per
    epoch."""
    work = cluster.workdir(tmp_path / "w", nnodes="1:2", rdzv_last_call_s=5, max_restarts=1, epochs=3)
    samples = tmp_path / "samples"
    samples.mkdir()
    logs = [tmp_path / "c1.log", tmp_path / "c2.log"]
    env = {"DETPIPE_SAMPLE_LOG": str(samples)}
    procs = [cluster.start("c1", work, logs[0], env), cluster.start("c2", work, logs[1], env)]
    _wait_for(lambda: (work / "checkpoints/ckpt-0000001.pt").exists(), procs, "a first checkpoint")
    assert torch.load(work / "checkpoints/ckpt-0000001.pt", weights_only=True)["world_size"] == 2
    killed = time.time()
    cluster.hosts.kill("c2")
    procs[1].wait(timeout=30)
    (text,) = _finish(procs[:1], logs[:1])
    assert _log_time(text, "resuming from") - killed < RECOVERY_S
    assert "rank 0/1" in text
    _samples_once(samples, text)
    assert torch.load(work / "models/model.pt", weights_only=True)["iters"] > 6
    _nothing_left(cluster)


def test_cut_link_times_out_and_the_job_goes_on(cluster, tmp_path):
    """``nnodes: 1:2``; c2's link set down after the first checkpoint, in the middle of the all-reduces: no TCP
    reset, c2 just stops answering. With ``collective_timeout_s: 5`` c1's worker fails its collective after
    5 s naming the lost host (c2), torchrun restarts the group without c2 (its rendezvous heartbeats stopped)
    and the training finishes from the newest checkpoint within `RECOVERY_S`. (Without the timeout gloo waits
    30 min: tests/system/test_distributed.py shows a frozen peer blocking the others.)"""
    work = cluster.workdir(tmp_path / "w", nnodes="1:2", rdzv_last_call_s=5, max_restarts=1, epochs=4,
                           collective_timeout_s=5)
    logs = [tmp_path / "c1.log", tmp_path / "c2.log"]
    procs = [cluster.start("c1", work, logs[0]), cluster.start("c2", work, logs[1])]
    try:
        _wait_for(lambda: (work / "checkpoints/ckpt-0000001.pt").exists(), procs, "a first checkpoint")
        cut = time.time()
        cluster.hosts.link("c2", up=False)
        (text,) = _finish(procs[:1], logs[:1], timeout=RECOVERY_S * 3)
    finally:
        cluster.hosts.kill("c2")      # c2's agent is still waiting for a store it cannot reach
        cluster.hosts.link("c2", up=True)
        wait_idle(cluster.slurm)      # Slurm may have marked c2 not responding: the next tests need it
    lost = re.search(r"error: rank \d/2 \(host c1 pid \d+\): a collective timed out after 5 s "
                     r"\(train.collective_timeout_s\) - no answer from rank \d \(host c2 pid \d+\)", text)
    assert lost, text[-3000:]
    assert 5 <= _log_time(text, "resuming from") - cut < RECOVERY_S
    assert "rank 0/1" in text and torch.load(work / "models/model.pt", weights_only=True)["iters"] > 6
    _nothing_left(cluster)


def _scontrol(cluster: Cluster, *args: str) -> str:
    proc = subprocess.run(["scontrol", *args], env=cluster.slurm, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_slurm_node_down_requeues_and_resumes(cluster, tmp_path):
    """A 2-node Slurm job (``nnodes: 2``: it cannot go on with one); one of its nodes set DOWN by the admin
    (``scontrol update state=down``) after the first checkpoint: Slurm ends the job and requeues it
    (``--requeue``), it starts again on two nodes that are up (start 2) and resumes from the newest checkpoint;
    the stage, which followed the job, exits 0 with the whole run's log."""
    wait_idle(cluster.slurm)   # three nodes up: the requeued job has two to start on
    work = cluster.workdir(tmp_path / "w", nnodes=2, launcher="slurm", epochs=6)
    out = tmp_path / "stage.log"
    stage = cluster.hosts.popen("ctl", [sys.executable, "-m", "stages.train"], cwd=work, env=cluster.env(),
                                stdout=open(out, "wb"), stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: (work / "checkpoints/ckpt-0000001.pt").exists(), [stage], "a first checkpoint")
        (job,) = [line.split() for line in squeue(cluster.slurm).splitlines()]
        assert job[1] == "RUNNING", job
        node = "c2" if "c2" in _scontrol(cluster, "show", "hostnames", job[2]) else "c1"
        down = time.time()
        _scontrol(cluster, "update", f"nodename={node}", "state=down", "reason=test_cluster")
        assert stage.wait(timeout=RECOVERY_S * 4) == 0, out.read_text()[-4000:]
    finally:
        subprocess.run(["scontrol", "update", "nodename=c1,c2,c3", "state=resume"], env=cluster.slurm,
                       capture_output=True)
        if stage.poll() is None:
            stage.send_signal(signal.SIGTERM)
            stage.wait(timeout=120)
    text = out.read_text()
    starts = re.findall(r"slurm job (\d+) \(start (\d)\) on (\S+),", text)
    assert [s[1] for s in starts] == ["1", "2"] and starts[0][0] == starts[1][0] == job[0], starts
    assert node not in _scontrol(cluster, "show", "hostnames", starts[1][2])   # started again without it
    assert len(re.findall(r"resuming from .*\(iteration (\d+)\)", text)) == 1
    assert _log_time(text, "resuming from") - down < RECOVERY_S + 30   # + Slurm's requeue delay (cred_expire)
    assert torch.load(work / "models/model.pt", weights_only=True)["iters"] == 12
    _nothing_left(cluster)


def _nothing_left(cluster: Cluster) -> None:
    """No process but the Slurm daemons is left on a compute host."""
    left = {}
    for host in ("c1", "c2", "c3"):
        for pid in set(cluster.hosts.pids(host)) - cluster.hosts.daemons:
            with contextlib.suppress(OSError):
                left[pid] = (host, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
    assert not left, left


def test_cancelled_prefect_run_cancels_its_slurm_job(cluster, prefect_api, reproduced_repo, tmp_path):
    """A Prefect run of ``train/<deployment>`` whose train stage uses ``launcher: slurm`` (a 2-node job on the
    cluster, the run's workspace on the shared filesystem), cancelled while the job trains: the run ends
    Cancelled, the stage (stopped with SIGTERM, as Prefect stops it) cancels the job (``scancel``), ``squeue``
    lists nothing, no process is left on any host."""
    from support.prefect import Prefect
    from support.procs import stop_group
    from support.repos import flow_repo

    wait_idle(cluster.slurm)   # c1 and c2 up: the elastic job gets both
    prefect = Prefect({**prefect_api.env, **cluster.s3.env(), "SLURM_CONF": cluster.slurm["SLURM_CONF"]},
                      prefect_api.logs)
    try:
        prefect.serving("slurm")
        repo = flow_repo(reproduced_repo, tmp_path / "repo", train={
            "launcher": "slurm", "nnodes": "1:2", "rdzv_endpoint": f"x:{PORT}", "socket_ifname": IFNAME,
            "epochs": 100, "checkpoint_every": 1, "threads": 1})
        run = prefect.start_run(repo, None, "slurm-cancelled", deployment="train/slurm")
        jobs: list[list[str]] = []
        logs: list[Path] = []

        def job_logging() -> bool:
            # Wait for the job's log itself, not for a sign of it: squeue says RUNNING once slurmctld has allocated
            # the nodes, but the log is created only when slurmstepd starts the batch step on the first node, a
            # moment later; and checkpoints in the run's workspace prove nothing about this job, as the workspace
            # starts with the reproduced run's (`checkpoints` is a `persist: true` output, checked out) until the
            # job's rank 0 removes them.
            jobs[:] = [line.split() for line in squeue(cluster.slurm).splitlines()]
            if not (jobs and jobs[0][1] == "RUNNING"):
                return False
            logs[:] = (repo / ".dvc/tmp/runs").glob(f"*/logs/slurm-{jobs[0][0]}.out")
            return bool(logs)

        _wait_for(job_logging, [run], "a running Slurm job with its log")
        # an elastic job (nnodes 1:2: --nodes=2, --no-kill) got both nodes, one agent on each
        assert _scontrol(cluster, "show", "hostnames", jobs[0][2]).split() == ["c1", "c2"], jobs
        (log,) = logs   # the job's log, in the run's workspace

        def ranks_training() -> bool:
            # each rank logs "rank r/2 on ..." just before its first iteration, in no fixed order (rank 0 first
            # looks for a checkpoint to resume from, rank 1 may get there first): wait for both lines
            text = log.read_text(errors="replace")
            return "rank 0/2" in text and "rank 1/2" in text

        _wait_for(ranks_training, [run], "both ranks of the job training")
        assert "rank 0/2" in log.read_text(errors="replace") and "rank 1/2" in log.read_text(errors="replace")
        prefect.cli("flow-run", "cancel", prefect.id_of("slurm-cancelled"))
        final = prefect.wait_final(prefect.id_of("slurm-cancelled"), timeout=120)
        run.communicate(timeout=120)
        assert final["state"]["type"] == "CANCELLED", final["state"]
        deadline = time.monotonic() + 30
        while squeue(cluster.slurm).strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not squeue(cluster.slurm).strip()
        assert f"cancelling slurm job {jobs[0][0]}" in prefect.logs_of(prefect.id_of("slurm-cancelled"))
        _nothing_left(cluster)
    finally:
        stop_group(prefect.procs)


def test_namespaces_of_a_killed_test_run_are_removed():
    """A test run killed with SIGKILL cannot delete its namespaces; the next run's `netns_cluster.network` removes
    those whose owner (the pid in their name) is gone, and leaves a live run's alone."""
    dead = subprocess.Popen(["true"])
    dead.wait()                                   # a pid that no longer exists
    stale, live = f"{netns_cluster.PREFIX}{dead.pid}-c1", f"{netns_cluster.PREFIX}{os.getpid()}-zz"
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        assert netns_cluster.remove_stale() == [stale]
        assert stale not in netns_cluster.namespaces() and live in netns_cluster.namespaces()
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
