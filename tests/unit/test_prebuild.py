"""`support.prebuild` under pytest-xdist: a shared session fixture is built once for every worker process of the
run, a worker asking for it meanwhile waits and gets the same value, a failed build fails every asker, and one
background thread for the whole run builds the queue. Real processes (``python -c``), as two xdist workers are."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.procs import stage_env

TESTS = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, os, sys, time
from pathlib import Path
from support import prebuild

shared, log, fail, queue = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "fail", sys.argv[4] == "queue"

class Factory:                                  # what the build uses of pytest's tmp_path_factory
    def getbasetemp(self):
        return shared
    def mktemp(self, name):
        path = shared / f"{name}-{os.getpid()}"
        path.mkdir()
        return path

def build(factory):
    with log.open("a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(1.5)                             # long enough for the other worker to ask meanwhile
    if fail:
        raise ValueError("broken build")
    return factory.mktemp("work")

prebuild.register("work", build)
prebuild.set_factory(Factory(), shared)
background = prebuild.schedule(["work"]) if queue else None
try:
    out = {"value": str(prebuild.get("work")), "background": background is not None}
except Exception as e:
    out = {"error": f"{type(e).__name__}: {e}", "background": background is not None}
print(json.dumps(out))
"""


def _two_workers(tmp_path: Path, fail: bool = False, queue: bool = False) -> tuple[list[dict], list[str]]:
    log = tmp_path / "builds.log"
    cmd = [sys.executable, "-c", WORKER, str(tmp_path), str(log), "fail" if fail else "-", "queue" if queue else "-"]
    env = stage_env({"PYTHONPATH": f"{TESTS}"})
    workers = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    outs = []
    for w in workers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
        outs.append(json.loads(out.splitlines()[-1]))
    return outs, log.read_text().split()


def test_a_shared_build_is_built_once_for_two_workers(tmp_path):
    outs, builders = _two_workers(tmp_path)
    assert len(builders) == 1, f"built {len(builders)} times"
    assert outs[0]["value"] == outs[1]["value"] and Path(outs[0]["value"]).is_dir()
    assert Path(outs[0]["value"]).name == f"work-{builders[0]}"


def test_a_failed_shared_build_fails_both_workers_once(tmp_path):
    outs, builders = _two_workers(tmp_path, fail=True)
    assert len(builders) == 1, f"built {len(builders)} times"
    errors = sorted(o["error"] for o in outs)
    assert errors[0].startswith("RuntimeError: session fixture 'work' failed in another xdist worker")
    assert "ValueError: broken build" in errors[0]
    assert errors[1] == "ValueError: broken build"


def test_one_background_thread_for_the_run(tmp_path):
    outs, builders = _two_workers(tmp_path, queue=True)
    assert sorted(o["background"] for o in outs) == [False, True]
    assert len(builders) == 1 and outs[0]["value"] == outs[1]["value"]
