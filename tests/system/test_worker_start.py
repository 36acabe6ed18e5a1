"""Workers forked from torchrun's agent (`detpipe.launch.worker_start.run_forked_worker`, the default) start as a new
interpreter would: named, in a session of their own, with default signal handlers, their own ``sys.argv``, the
agent's ``atexit`` functions gone and their own run, torch threads from ``OMP_NUM_THREADS``; a bug's traceback is
printed; and they train the same weights as workers started by exec (plain torchrun).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from detpipe.launch.worker_start import WORKER_START_ENV
from support.procs import free_port, run, stage_env

# A worker module: writes what a worker sees of its process, then (argv[1] == "boom") raises a bug. The agent's
# atexit function must not run in the worker; the worker's own must.
_WORKER = '''
import atexit, json, os, signal, sys
import torch

WORKER_PRELOAD = ("json",)

if __name__ == "__main__":
    out = os.environ["PROBE_OUT"] + "." + os.environ["LOCAL_RANK"]
    atexit.register(lambda: open(out + ".atexit", "w").write("worker"))
    json.dump({"comm": open("/proc/self/comm").read().strip(), "own_session": os.getsid(0) == os.getpid(),
               "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
               "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
               "argv": sys.argv[1:], "threads": torch.get_num_threads(),
               "parent_is_agent": os.getppid() == int(os.environ["DETPIPE_LAUNCHER_PID"])}, open(out, "w"))
    if sys.argv[1:] == ["boom"]:
        raise RuntimeError("a bug in the worker")
'''
# The agent: registers an atexit function that would mark the worker's file, then runs torchrun's agent in-process.
_AGENT = '''
import atexit, os, sys
atexit.register(lambda: open(os.environ["PROBE_OUT"] + ".agent_atexit." + str(os.getpid()), "w").write("agent"))
from detpipe.launch.torchrun import main
main(sys.argv[1:])
'''


def _run_agent(tmp_path: Path, nproc: int, worker_arg: str) -> subprocess.CompletedProcess:
    (tmp_path / "probe_worker.py").write_text(_WORKER)
    argv = ["--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "probe", "--max-restarts", "0",
            "-m", "probe_worker", worker_arg]
    env = stage_env({"PROBE_OUT": str(tmp_path / "probe"), "OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-c", _AGENT, *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_forked_workers_start_as_a_new_interpreter(tmp_path):
    proc = _run_agent(tmp_path, 2, "ok")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"probe.{rank}").read_text())
        assert seen == {"comm": f"probe_work-r{rank}", "own_session": True, "sigterm_default": True,
                        "sigint_default": True, "argv": ["ok"], "threads": 1, "parent_is_agent": True}, seen
        assert (tmp_path / f"probe.{rank}.atexit").read_text() == "worker"
    agent_marks = list(tmp_path.glob("probe.agent_atexit.*"))
    assert len(agent_marks) == 1, f"the agent's atexit function ran {len(agent_marks)} times (in a worker?)"


def test_a_bug_in_a_forked_worker_prints_its_traceback(tmp_path):
    proc = _run_agent(tmp_path, 1, "boom")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()  # the worker's own traceback, as an interpreter prints it (not only the agent's log)
    assert "Traceback (most recent call last):" in lines and "RuntimeError: a bug in the worker" in lines, proc.stderr
    assert "error: probe_worker failed: rank 0 exited with code 1" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_forked_and_exec_workers_train_the_same_weights(trained_workdir, tmp_path):
    """The session's `trained_workdir` ran with forked workers; the same params with exec'd ones give the same
    ``models/model.pt`` bytes."""
    work = tmp_path / "w"
    shutil.copytree(trained_workdir, work, ignore=shutil.ignore_patterns("checkpoints", "models", "dvclive"))
    run([sys.executable, "-m", "stages.train"], work, env={WORKER_START_ENV: "exec"})
    assert (work / "models/model.pt").read_bytes() == (trained_workdir / "models/model.pt").read_bytes()

