"""Distributed training on one machine: a 2-node torchrun job (two launches on 127.0.0.1, c10d rendezvous),
2 processes per node, the non-finite-loss guard, and the collective timeout (a frozen peer). Restarts and elastic
world sizes: tests/system/test_elastic.py."""
from __future__ import annotations

import os
import contextlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import yaml

from support.pipeline import stage_cli, write_params
from support.procs import free_port, stage_env, stop_group


def _node(cached, dest, overrides):
    shutil.copytree(cached / "data", dest / "data")
    write_params(dest, overrides)
    return dest


def _digests(stderr: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"rank (\d+) final weights digest ([0-9a-f]+)", stderr)}


@pytest.mark.slow
def test_two_node_job_keeps_ranks_equal(cached_workdir, tmp_path):
    """Two torchrun agents ("nodes", own working directories) meet at one c10d rendezvous; the rendezvous, not
    the params, decides which node holds global rank 0."""
    port = free_port()
    common = {"nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}", "epochs": 1, "batch_size": 2, "threads": 1}
    nodes = [_node(cached_workdir, tmp_path / f"node{r}", {"train": common}) for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=n, env=stage_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in nodes]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    d0, d1 = _digests(outs[0][1]), _digests(outs[1][1])
    assert sorted([*d0, *d1]) == [0, 1] and len(d0) == len(d1) == 1, (d0, d1)
    assert len({*d0.values(), *d1.values()}) == 1
    first = 0 if 0 in d0 else 1
    assert "rank 0/2" in outs[first][1] and "rank 1/2" in outs[1 - first][1]
    # only global rank 0 writes the model; the other node has none
    assert (nodes[first] / "models/model.pt").is_file() and not (nodes[1 - first] / "models/model.pt").exists()
    # each rank saw half the data per step: 9 training images // (2 ranks x batch 2) = 2 iterations
    assert torch.load(nodes[first] / "models/model.pt", weights_only=True)["iters"] == 2


@pytest.mark.slow
def test_single_node_two_processes(two_rank_workdir):
    """One torchrun agent with 2 worker processes: both ranks end with the same weights. The run is the session's
    `two_rank_workdir` (1 node, ``nproc_per_node: 2``, batch 2; the stage's real run, its stderr kept beside it),
    the reference of the elastic and cluster tests, not a run of its own."""
    from conftest import TWO_RANK_LOG

    train = yaml.safe_load((two_rank_workdir / "params.yaml").read_text())["train"]
    assert (str(train["nnodes"]), train["nproc_per_node"], train["batch_size"]) == ("1", 2, 2), train
    d = _digests((two_rank_workdir.parent / TWO_RANK_LOG).read_text())
    assert set(d) == {0, 1} and d[0] == d[1]


def test_non_finite_losses_stop_training(cached_workdir, tmp_path):
    """A huge learning rate makes the loss non-finite: steps are skipped and counted, then training stops with
    a one-line error once train.max_bad_steps is exceeded."""
    work = _node(cached_workdir, tmp_path / "w", {"train": {"lr": 1e30, "warmup_iters": 0, "max_bad_steps": 1,
                                                            "epochs": 10}})
    proc = stage_cli("train", work, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert any("non-finite loss" in e and "train.max_bad_steps=1" in e for e in errors), proc.stderr[-2000:]
    assert "step skipped" in proc.stderr
    assert not (work / "models/model.pt").exists()


# A worker of a 2-process gloo group as torchrun starts one (RANK, WORLD_SIZE, MASTER_ADDR/PORT, the store hosted
# outside the workers, by the test as by torchrun's agent): the product's setup and error handling, then
# all-reduces until stopped, printing "step N" after each.
PEER = """
import sys, torch, torch.distributed as dist
from detpipe.core.errors import run_program
from detpipe.core.distributed import collective_errors, setup_distributed

def main():
    setup_distributed()
    with collective_errors():
        step = 0
        while True:
            dist.all_reduce(torch.ones(4))
            step += 1
            print(f"step {step}", flush=True)

run_program(main, "peer")
"""


def _frozen_peer(tmp_path, timeout_s: float, deadline_s: float) -> tuple[float | None, str, int]:
    """Start two `PEER` ranks, SIGSTOP rank 1 once both are all-reducing (a peer that stops answering without
    closing its connections: what a host cut off the network looks like to the other), and wait up to
    ``deadline_s`` seconds for rank 0 to exit. Returns (seconds rank 0 took to exit, None if it was still blocked
    at the deadline; rank 0's output; rank 1's pid)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True,  # port 0: the kernel picks one, no race
                          timeout=timedelta(seconds=30))
    base = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "DETPIPE_COLLECTIVE_TIMEOUT_S": str(timeout_s),
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-c", PEER], env=stage_env({**base, "RANK": str(r),
                                                                           "LOCAL_RANK": str(r)}),
                              stdout=open(logs[r], "w"), stderr=subprocess.STDOUT, start_new_session=True)
             for r in (0, 1)]
    try:
        start = time.monotonic()
        while not all("step 3" in log.read_text() for log in logs):
            assert all(p.poll() is None for p in procs) and time.monotonic() - start < 60, \
                [log.read_text()[-2000:] for log in logs]
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            procs[0].wait(timeout=deadline_s)
            took = time.monotonic() - frozen
        except subprocess.TimeoutExpired:
            took = None
        return took, logs[0].read_text(), procs[1].pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[1].pid, signal.SIGCONT)
        stop_group(procs)
        del store


FROZEN_TIMEOUT_S = 3  # train.collective_timeout_s of the frozen-peer tests
FROZEN_SLACK_S = 8  # seconds allowed beyond the timeout and the roll call (exit, on a loaded machine)


@pytest.fixture(scope="module")
def frozen_peers(tmp_path_factory) -> dict:
    """`_frozen_peer` with ``train.collective_timeout_s`` = `FROZEN_TIMEOUT_S` and with gloo's default (1800 s,
    what every worker had before the setting), both at once (each pair keeps about one core busy until the
    freeze); the bound each waits is the timeout + the roll call + `FROZEN_SLACK_S`."""
    from concurrent.futures import ThreadPoolExecutor

    from detpipe.core.distributed import ROLL_CALL_S

    bound = FROZEN_TIMEOUT_S + min(ROLL_CALL_S, FROZEN_TIMEOUT_S) + FROZEN_SLACK_S
    with ThreadPoolExecutor(2) as pool:
        runs = {t: pool.submit(_frozen_peer, tmp_path_factory.mktemp(f"frozen{t}"), t, bound)
                for t in (FROZEN_TIMEOUT_S, 1800)}
        return {"bound": bound, **{t: f.result() for t, f in runs.items()}}


def test_frozen_peer_fails_the_collective_within_its_timeout(frozen_peers):
    """A rank whose peer stops answering (SIGSTOP: no TCP reset, as with a host cut off the network) fails its
    all-reduce after ``train.collective_timeout_s`` + the roll call, exits with status 2 and one line naming the
    timeout and the lost rank with its host and pid (the elastic agent then restarts the group)."""
    bound = frozen_peers["bound"]
    took, out, frozen_pid = frozen_peers[FROZEN_TIMEOUT_S]
    assert took is not None, "rank 0 still blocked: " + out[-2000:]
    print(f"rank 0 exited {took:.1f} s after its peer froze")
    assert FROZEN_TIMEOUT_S - 0.5 <= took <= bound, took
    errors = [l for l in out.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert re.fullmatch(rf"error: rank 0/2 \(host {re.escape(socket.gethostname())} pid \d+\): a collective timed "
                        rf"out after 3 s \(train.collective_timeout_s\) - no answer from rank 1 \(host "
                        rf"{re.escape(socket.gethostname())} pid {frozen_pid}\): lost or frozen; torchrun restarts "
                        rf"the group", errors[0]), errors[0]


def test_frozen_peer_blocks_without_the_timeout(frozen_peers):
    """The failure the timeout fixes (and that the test above would catch): with gloo's default timeout (30 min,
    what every worker had before train.collective_timeout_s) the surviving rank is still blocked at the end of
    the bound the test above allows."""
    took, out, _ = frozen_peers[1800]
    assert took is None, out[-2000:]
    assert "error:" not in out


def test_a_timeout_seen_as_pair_closure_is_named_a_timeout():
    """gloo raises ``Timed out waiting ...`` only in the operation whose wait expired; every other operation pending
    on the group gets ``Application timeout caused pair closure`` (gloo's UnboundBuffer::waitRecv). A worker whose
    DDP broadcast was that other operation once printed a bare traceback on a cut link instead of the timeout's
    line (CI, tests/system/test_cluster.py). Real gloo errors, from two ranks in two threads of this process (rank 1
    never sends): both count as timeouts; an unrelated error does not."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from detpipe.core.distributed import _timed_out

    store, errors, done = dist.HashStore(), {}, threading.Event()

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore("pair-closure", store), r, 2, timedelta(seconds=0.5))
        if r == 1:
            done.wait(30)   # connected and silent, like a peer behind a cut link
            return
        works = [group.recv([torch.zeros(1)], 1, tag) for tag in (0, 1)]
        for tag, work in enumerate(works):
            try:
                work.wait()
            except RuntimeError as e:
                errors[tag] = e
        done.set()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert "Timed out waiting 500ms for recv" in str(errors[0]), errors
    assert str(errors[1]) == "Application timeout caused pair closure", errors
    assert _timed_out(errors[0]) and _timed_out(errors[1])
    assert not _timed_out(RuntimeError("Connection closed by peer [198.18.0.12]:4711"))
