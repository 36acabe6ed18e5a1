"""Distributed training on one machine: a 2-node torchrun job (two launches on 127.0.0.1, c10d rendezvous),
2 processes per node, and the non-finite-loss guard. Restarts and elastic world sizes: tests/test_elastic.py."""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from support.pipeline import stage_cli, write_params
from support.procs import stage_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
def test_single_node_two_processes(cached_workdir, tmp_path):
    work = _node(cached_workdir, tmp_path / "w", {"train": {"nproc_per_node": 2, "epochs": 1, "batch_size": 2,
                                                            "threads": 1}})
    proc = stage_cli("train", work)
    d = _digests(proc.stderr)
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
