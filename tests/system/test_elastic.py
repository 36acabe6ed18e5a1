"""Elastic launch (torchrun c10d rendezvous): a killed worker, a killed and restarted node, a world size that
shrinks on restart; single-node stores on 127.0.0.1 only; the rendezvous host recognized by its interface
address. Real trainings on COCO128 images, real processes
killed with SIGKILL."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from detpipe.launch.worker_start import worker_local_rank
from support.pipeline import assert_same_training_state, checkpoint, checkpoints, elastic_workdir, write_params
from support.procs import stage_env
from support.procs import free_port


def _start(work: Path, log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=work, env={**stage_env(), **(env or {})},
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert all(p.poll() is None for p in procs), "training ended before it could be killed"
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def _workers(agent_pid: int) -> dict[int, psutil.Process]:
    """The agent's worker processes by local rank (`detpipe.launch.worker_start.worker_local_rank`)."""
    out = {}
    for child in psutil.Process(agent_pid).children():
        rank = worker_local_rank(child)
        if rank is not None:
            out[rank] = child
    return out


def _finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 600) -> list[str]:
    for p in procs:
        p.wait(timeout=timeout)
    texts = [Path(l).read_text() for l in logs]
    for p, text in zip(procs, texts):
        assert p.returncode == 0, text[-4000:]
    return texts


def _assert_same_final_state(a_dir: Path, b_dir: Path) -> int:
    return assert_same_training_state(checkpoints(a_dir)[-1], checkpoints(b_dir)[-1])


def _listening(pid: int) -> list[str]:
    return sorted({c.laddr.ip for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN})


def test_plain_tcpstore_listens_on_all_interfaces():
    """What the loopback check below guards against: torch's TCPStore server binds the wildcard address even when
    asked for 127.0.0.1 (so `_listening` does detect a store open to the network)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True)
    assert _listening(os.getpid()) and set(_listening(os.getpid())) & {"0.0.0.0", "::"}, _listening(os.getpid())
    del store


def test_store_port_can_be_bound_again_during_time_wait():
    """A node that hosted the rendezvous store and starts again within TCP's TIME_WAIT (a requeued job on the same
    first node) binds the port again (`bind_listener` sets SO_REUSEADDR); a port that another socket listens on
    is still refused (how an agent finds the store of another agent on the same machine)."""
    from detpipe.core.net import bind_listener

    server = bind_listener("127.0.0.1", 0)
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()          # the store's side closes first: its end of the connection goes to TIME_WAIT
    server.close()
    client.close()
    time.sleep(0.2)
    assert any(c.laddr.port == port and c.status == psutil.CONN_TIME_WAIT for c in psutil.net_connections("tcp"))
    with pytest.raises(OSError):  # what the old listener (no SO_REUSEADDR) hit
        with socket.socket() as plain:
            plain.bind(("127.0.0.1", port))
    again = bind_listener("127.0.0.1", port)
    with pytest.raises(OSError):
        bind_listener("127.0.0.1", port)   # taken by a listener: refused
    again.close()


@pytest.mark.slow
def test_killed_worker_restarts_group_bit_identical(cached_workdir, tmp_path, two_rank_workdir):
    """2(a): kill -9 of one worker mid-epoch -> torchrun restarts the worker group -> it resumes from the newest
    checkpoint and ends with the weights and optimizer state of the uninterrupted run. The single-node job's
    rendezvous stores listen on 127.0.0.1 only."""
    work = elastic_workdir(cached_workdir, tmp_path / "killed", {"nproc_per_node": 2})
    log = tmp_path / "killed.log"
    agent = _start(work, log)
    _wait_for(checkpoint(work, 1), [agent])  # iteration 1 = epoch 0, position 1 of 2
    assert _listening(agent.pid) == ["127.0.0.1"], _listening(agent.pid)
    victim = _workers(agent.pid)[1]
    os.kill(victim.pid, signal.SIGKILL)
    (text,) = _finish([agent], [log])
    resumed = [l for l in text.splitlines() if "resuming from" in l]
    assert "starting fresh" in text  # the first start; the restarted group then resumed mid-epoch 0:
    assert len(resumed) == 1 and "(iteration 1)" in resumed[0], "the kill came too late: " + str(resumed)
    final = _assert_same_final_state(two_rank_workdir, work)
    assert final == 4
    # the curves have one row per iteration: the restarted group did not log an iteration twice
    rows = (work / "dvclive/plots/metrics/train/loss.tsv").read_text().splitlines()[1:]
    assert [int(r.split("\t")[0]) for r in rows] == list(range(1, final + 1))


@pytest.mark.slow
def test_killed_node_rejoins_bit_identical(cached_workdir, tmp_path, two_rank_workdir):
    """2(b): two torchrun agents ("nodes", 1 worker each) on 127.0.0.1 sharing a working directory (a shared
    filesystem); node 1 is killed with SIGKILL mid-epoch (its worker dies with it) and started again: node 0's
    agent restarts its worker, both meet at the next rendezvous round and finish bit-identical to a 2-process
    run."""
    port = free_port()
    work = elastic_workdir(cached_workdir, tmp_path / "w", {"nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}"})
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "node1-again.log"]
    node0 = _start(work, logs[0])
    _wait_for_listener(port, node0)  # node 0's agent hosts the rendezvous store
    node1 = _start(work, logs[1])
    _wait_for(checkpoint(work, 1), [node0, node1])
    os.kill(node1.pid, signal.SIGKILL)
    node1.wait()
    again = _start(work, logs[2])
    texts = _finish([node0, again], [logs[0], logs[2]])
    assert sum("resuming from" in t for t in texts) == 1
    _assert_same_final_state(two_rank_workdir, work)


def _wait_for_listener(port: int, proc: subprocess.Popen, timeout: float = 120, host: str = "127.0.0.1") -> None:
    deadline = time.time() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        assert proc.poll() is None and time.time() < deadline, "the rendezvous store did not start"
        time.sleep(0.1)


def test_epoch_plan_matches_plain_schedule_and_finishes_a_resized_epoch():
    """`EpochPlan` without a change of world size is the plain ``divmod`` schedule; after one it finishes the
    interrupted epoch first (its length read from the sampler) and then counts whole epochs."""
    from detpipe.data.sampler import ResumableDistributedSampler
    from detpipe.engine.elastic import EpochPlan

    plain = EpochPlan(iters_per_epoch=4, per_step=2)
    assert [plain.locate(i) for i in range(9)] == [(i // 4, i % 4 * 2, 0) for i in range(9)]
    assert plain.max_iter(3) == 12
    sampler = ResumableDistributedSampler(16, 2, 1)
    sampler.set_epoch(1, 6)  # 3 iterations into epoch 1: 2 indices (1 iteration) left
    resumed = EpochPlan.resumed(7, sampler, 4, 2)
    assert [resumed.locate(i) for i in (7, 8, 9)] == [(1, 6, 0), (2, 0, 0), (2, 2, 0)]
    assert resumed.max_iter(3) == plain.max_iter(3)
    # the last checkpoint of a completed run: its sampler points at the start of epoch 3 -> nothing left to train
    sampler.set_epoch(3, 0)
    done = EpochPlan.resumed(12, sampler, 4, 2)
    assert done.max_iter(3) == 12 and done.max_iter(4) == 16
    # a sampler that still yields 6 indices of epoch 1 (e.g. loaded from a larger world size): 3 more iterations
    shrunk = EpochPlan(4, 2, start_iter=5, epoch=1, start=0, first_iters=3, offset=4)
    assert [shrunk.locate(i) for i in (5, 7, 8)] == [(1, 0, 4), (1, 4, 4), (2, 0, 0)]
    assert shrunk.max_iter(3) == 5 + 3 + 4
    with pytest.raises(ValueError):
        shrunk.locate(4)


def _rendezvous_free(argv: list[str]) -> list[str]:
    """torchrun arguments with the values of --rdzv-endpoint and --rdzv-id blanked (they name the job's hosts)."""
    return [("*" if i and argv[i - 1] in ("--rdzv-endpoint", "--rdzv-id") else a) for i, a in enumerate(argv)]


@pytest.mark.parametrize("kind", ["k8s", "slurm"])
def test_emitted_job_runs_the_local_launchers_command(tmp_path, monkeypatch, kind):
    """``--emit k8s`` (a Kubeflow PyTorchJob) and ``--emit slurm`` run the torchrun command and environment the
    local launcher builds from the same params; only the rendezvous host and id are the scheduler's."""
    import shlex

    import yaml

    from detpipe.launch.torchrun_args import launch_env
    from detpipe.params import load
    from detpipe.launch.emit import emit
    from detpipe.launch.jobs import launch_args

    write_params(tmp_path, {"train": {"nnodes": "2:4", "nproc_per_node": 8, "max_restarts": 5, "threads": 2,
                                      "rdzv_endpoint": "10.1.2.3:29500", "slurm_extra": ["--gres=gpu:8"],
                                      "k8s_pvc": "detpipe-shared"}})
    monkeypatch.chdir(tmp_path)  # what `python -m detpipe.launch.emit KIND` prints there (tests/system/test_cluster.py runs it)
    cfg = load("train", tmp_path / "params.yaml")
    text = emit(cfg, kind)
    local, env = launch_args(cfg), launch_env(cfg)
    if kind == "k8s":
        job = yaml.safe_load(text)
        worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
        (container,) = worker["template"]["spec"]["containers"]
        command = container["command"]
        assert command[:3] == ["python", "-m", "detpipe.launch.torchrun"]  # torchrun through our agent
        argv = command[3:]
        assert {e["name"]: e["value"] for e in container["env"]} == env
        name = job["metadata"]["name"]
        assert argv[argv.index("--rdzv-endpoint") + 1] == f"{name}-worker-0:29500"
        assert argv[argv.index("--rdzv-id") + 1] == name
        assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 4,
                                                "maxRestarts": 5}
        assert job["spec"]["nprocPerNode"] == "8"
        assert worker["replicas"] == 4
    else:
        (srun,) = [l for l in text.splitlines() if l.startswith("srun ")]
        words = shlex.split(srun)
        argv = words[words.index("detpipe.launch.torchrun") + 1:]  # torchrun through our agent (is_host decided there)
        assert argv[argv.index("--rdzv-endpoint") + 1] == "${RDZV_HOST}:29500"
        assert argv[argv.index("--rdzv-id") + 1] == "${SLURM_JOB_ID}"
        (export,) = [l for l in text.splitlines() if l.startswith("export ")]
        assert dict(w.split("=", 1) for w in shlex.split(export)[1:]) == env
        assert "#SBATCH --nodes=4\n" in text and "#SBATCH --no-kill" in text and "#SBATCH --gres=gpu:8" in text
    assert _rendezvous_free(argv) == _rendezvous_free(local)
    assert argv != local  # the comparison above is not vacuous: the scheduler's rendezvous address differs


def _address_hostname_misses() -> str | None:
    """An IPv4 address of this machine's interfaces (not loopback) that its hostname does not resolve to, or None."""
    from detpipe.launch.torchrun_args import local_addresses

    named = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP)}
    found = sorted(a for a in local_addresses() if "." in a and not a.startswith("127.") and a not in named)
    return found[0] if found else None


def test_endpoint_host_is_recognized_by_interface_address():
    """`is_endpoint_host` on this machine's real addresses: every interface address, any loopback address (127.0.0.2
    is one on Linux though no interface lists it), the hostname, are this machine's; an address from the
    benchmarking range that no interface has, and a name that does not resolve, are not. torch's own test misses
    an interface address the hostname does not resolve to (the bug: no node hosted the rendezvous)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    from detpipe.launch.torchrun_args import is_endpoint_host, local_addresses

    addresses = local_addresses()
    assert "127.0.0.1" in addresses and "127.0.0.2" not in addresses
    assert all(is_endpoint_host(a) for a in addresses), addresses
    assert is_endpoint_host("127.0.0.2") and is_endpoint_host(socket.gethostname()) and is_endpoint_host("localhost")
    assert "198.18.0.1" not in addresses and not is_endpoint_host("198.18.0.1")
    assert not is_endpoint_host("no-such-host.invalid")
    missed = _address_hostname_misses()
    if missed is None:
        pytest.skip("every interface address here is one the hostname resolves to: torch's test cannot miss one")
    assert is_endpoint_host(missed) and not _matches_machine_hostname(missed), missed


def test_plain_torchrun_finds_no_rendezvous_host_at_such_an_address(tmp_path):
    """What the launcher fixes: plain torchrun given that address as its endpoint does not host the store (torch's
    hostname test says it is another machine's) and fails connecting to it as a client."""
    missed = _address_hostname_misses()
    if missed is None:
        pytest.skip("every interface address here is one the hostname resolves to")
    port = free_port(missed)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", f"{missed}:{port}", "--rdzv-conf", "read_timeout=3", "-m", "json.tool"],
                          env=stage_env(), capture_output=True, text=True, timeout=120, start_new_session=True)
    assert proc.returncode != 0 and "RendezvousConnectionError" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_two_nodes_meet_at_an_interface_address_the_hostname_misses(cached_workdir, tmp_path, two_rank_workdir):
    """Two nodes (agents on this machine) with the endpoint given as an interface address the hostname does not
    resolve to: the launcher says which node hosts the store (is_host), the store listens on that address only,
    and the job trains to the same weights as a 2-process run."""
    missed = _address_hostname_misses()
    if missed is None:
        pytest.skip("every interface address here is one the hostname resolves to")
    port = free_port(missed)
    work = elastic_workdir(cached_workdir, tmp_path / "w", {"nnodes": 2, "rdzv_endpoint": f"{missed}:{port}",
                                                            "rdzv_join_timeout_s": 60})
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    node0 = _start(work, logs[0])
    _wait_for_listener(port, node0, host=missed)
    assert _listening(node0.pid) == [missed], _listening(node0.pid)
    node1 = _start(work, logs[1])
    texts = _finish([node0, node1], logs)
    assert all("is_host=true" in t for t in texts), [t[-2000:] for t in texts]
    _assert_same_final_state(two_rank_workdir, work)
