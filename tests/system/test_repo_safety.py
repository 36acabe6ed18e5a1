"""A repository no kill can break: `python -m detpipe.orchestration.repair repair` after ``kill -9`` of ``dvc repro`` at any moment.

Runs on a tiny real DVC pipeline (a copy per test): ``gen`` writes 600 files into ``out/`` through
``detpipe.core.files.atomic_dir`` from 300 listed source files and param ``n``; ``count`` reads ``out/``. With 300 deps
DVC's dvc.lock is ~30 kB and its rwlock ~25 kB, so their in-place rewrites (treeverse/dvc#7615) take long
enough for a kill to land inside them, as it does on the real pipeline (issue 14: 10 of 36 kills).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from support.procs import REPO, run, stage_env

from detpipe.orchestration import repair as detrepo

DVC = str(Path(sys.executable).parent / "dvc")
N_FILES = 600
N_DEPS = 300

GEN = f"""\
import yaml
from detpipe.core.files import atomic_dir

n = yaml.safe_load(open("params.yaml"))["n"]
with atomic_dir("out") as tmp:
    for i in range({N_FILES}):
        (tmp / f"f{{i:04d}}.txt").write_text(f"{{n}} {{i}}\\n")
"""
COUNT = """\
from pathlib import Path

files = sorted(Path("out").iterdir())
Path("count.txt").write_text(f"{len(files)} {files[0].read_text()}")
"""


def _set_n(root: Path, n: int) -> None:
    (root / "params.yaml").write_text(f"n: {n}\n")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    """A git + DVC repository with the tiny pipeline, run for n=1 (committed; `repair` then kept its dvc.lock as
    the backup) and then n=0 (the workspace). Both runs are in DVC's run cache."""
    root = tmp_path_factory.mktemp("tiny") / "repo"
    (root / "src").mkdir(parents=True)
    for i in range(N_DEPS):
        (root / "src" / f"d{i:03d}.txt").write_text(f"source {i}\n")
    (root / "gen.py").write_text(GEN)
    (root / "count.py").write_text(COUNT)
    stages = {"gen": {"cmd": "python gen.py", "deps": ["gen.py"] + [f"src/d{i:03d}.txt" for i in range(N_DEPS)],
                      "params": ["n"], "outs": ["out"]},
              "count": {"cmd": "python count.py", "deps": ["count.py", "out"], "outs": ["count.txt"]}}
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    _set_n(root, 1)
    for cmd in (["git", "init", "-q"], [DVC, "init", "-q"], [DVC, "config", "core.analytics", "false"],
                [DVC, "repro", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tiny pipeline"]):
        run(cmd, root)
    assert detrepo.repair(root) == []  # keeps .dvc/tmp/dvc.lock.backup: the lock of n=1
    _set_n(root, 0)
    run([DVC, "repro", "-q"], root)
    return root


@pytest.fixture
def work(pipeline, tmp_path) -> Path:
    dest = tmp_path / "repo"
    shutil.copytree(pipeline, dest, symlinks=True)
    return dest


def _dvc_broken(root: Path) -> str | None:
    """What DVC's own readers say about the rwlock and dvc.lock a kill left (None: both readable)."""
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA
    from dvc.utils.serialize import parse_yaml

    problems = []
    rwlock = root / ".dvc/tmp/rwlock"
    if rwlock.exists():
        try:
            json.loads(rwlock.read_text())
        except ValueError:
            problems.append(f"rwlock ({rwlock.stat().st_size} bytes) is not JSON")
    try:
        COMPILED_LOCKFILE_SCHEMA(parse_yaml((root / "dvc.lock").read_text(), "dvc.lock"))
    except Exception as e:  # noqa: BLE001 - whatever DVC raises on reading it
        problems.append(f"dvc.lock: {type(e).__name__}")
    return "; ".join(problems) or None


def _stat(path: Path):
    try:
        s = path.stat()
        return s.st_ino, s.st_mtime_ns, s.st_size
    except FileNotFoundError:
        return None


def _repro_killed(root: Path, trigger: tuple[str, float]) -> str:
    """Start ``dvc repro`` and ``kill -9`` its whole process group at ``trigger``: ("time", seconds after the
    start), ("temp", 1): once the stage's ``.out.tmp-*`` exists, or (file, k): at the k-th change seen of
    ``.dvc/tmp/rwlock``, ``dvc.lock`` or ``out``. Returns what happened."""
    kind, at = trigger
    watched = {"rwlock": root / ".dvc/tmp/rwlock", "dvc.lock": root / "dvc.lock", "out": root / "out"}
    proc = subprocess.Popen([DVC, "repro", "-q"], cwd=root, env=stage_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0, seen = time.monotonic(), 0
    last = _stat(watched[kind]) if kind in watched else None
    try:
        while proc.poll() is None:
            if kind == "time":
                fire = time.monotonic() - t0 >= at
            elif kind == "temp":  # the stage's atomic_dir exists: the stage is writing out/
                fire = any(root.glob(".out.tmp-*"))
            else:
                now = _stat(watched[kind])
                seen += now != last
                last, fire = now, seen >= at
            if fire:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return f"killed at {kind} {at} ({time.monotonic() - t0:.2f} s)"
            assert time.monotonic() - t0 < 300, "dvc repro hangs"
        return "finished before the trigger"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _assert_reproduced(root: Path, n: int, status: bool = True) -> None:
    """``dvc repro`` succeeds, the outputs are those of ``n``, no temporary is left beside them and (with
    ``status``) ``dvc status`` is clean."""
    run([DVC, "repro", "-q"], root)
    files = sorted((root / "out").iterdir())
    assert len(files) == N_FILES and files[0].read_text() == f"{n} 0\n"
    assert files[-1].read_text() == f"{n} {N_FILES - 1}\n"
    assert (root / "count.txt").read_text() == f"{N_FILES} {n} 0\n"
    assert [p.name for p in root.iterdir() if p.name.startswith((".out.", ".count.txt."))] == []
    if status:
        proc = run([DVC, "status", "--json"], root)
        assert json.loads(proc.stdout) == {}, proc.stdout


@pytest.mark.slow
def test_kill_anywhere_then_repair(work):
    """``kill -9`` of ``dvc repro`` at moments spread over its writes (rwlock rewrites, the checkout of
    ``out/`` from the cache or the stage writing it, dvc.lock's rewrite, plus random times), for cached
    params (DVC checks ``out`` out of its cache) and new ones (the stage runs): after each kill,
    ``python -m detpipe.orchestration.repair repair`` and a plain ``dvc repro`` must succeed with no manual step. The kills
    must leave DVC broken at least once (checked with DVC's own readers and a failing ``dvc status``), or the
    test proves nothing."""
    rng = random.Random(14)
    triggers = [("dvc.lock", 1), ("rwlock", 1), ("out", rng.randint(3, 40)), ("temp", 1),
                ("rwlock", rng.randint(2, 8)), ("dvc.lock", 2), ("time", rng.uniform(1.5, 4.0))]
    log, broken = [], []
    for trial, trigger in enumerate(triggers):
        n = (trial % 2) if trial % 3 else 10 + trial  # cached (0, 1) or new params (the stage runs)
        _set_n(work, n)
        what = _repro_killed(work, trigger)
        left = [p for p in psutil.process_iter(["cwd"]) if p.info["cwd"] and str(work) in p.info["cwd"]]
        assert not psutil.wait_procs(left, timeout=10)[1]      # SIGKILLed group members may take a moment to go
        damage = _dvc_broken(work)
        if damage:
            if not broken:  # DVC itself is stuck until repaired
                stuck = run([DVC, "status"], work, check=False)
                assert stuck.returncode != 0 and ("RWLock" in stuck.stderr or "dvc.lock" in stuck.stderr), stuck
            broken.append(damage)
        repaired = run([sys.executable, "-m", "detpipe.orchestration.repair", "repair"], work)
        log.append(f"trial {trial} n={n} {what}: {damage or 'readable'}; repair: {repaired.stderr.strip()[-300:]}")
        assert _dvc_broken(work) is None, log[-1]
        _assert_reproduced(work, n, status=False)
    proc = run([DVC, "status", "--json"], work)
    assert json.loads(proc.stdout) == {}, proc.stdout
    print("\n".join(log))
    assert broken, "no kill left DVC broken: the test does not exercise repair\n" + "\n".join(log)


def _cut_inside_count(text: str) -> str:
    """dvc.lock cut in the middle of the ``count`` stage's entry (DVC writes gen first, then count)."""
    start = text.index("\n  count:\n")
    return text[: start + (len(text) - start) // 2]


CORRUPTIONS = {  # (dvc.lock, rwlock or None to leave it) from (good dvc.lock, rwlock naming a dead DVC)
    "rwlock_cut": lambda lock, rw: (lock, rw[: len(rw) // 2]),
    "lock_empty": lambda lock, rw: ("", None),
    "lock_cut_in_count": lambda lock, rw: (_cut_inside_count(lock), None),
    "lock_cut_in_gen_rwlock_empty": lambda lock, rw: (lock[: lock.index("\n  count:\n") // 2], ""),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_repair_of_files_cut_as_dvc_leaves_them(work, case):
    """The files as a kill inside DVC's rewrite leaves them (a prefix of what it was writing): ``dvc status``
    fails without repair; after `repair` DVC works, and a rebuilt dvc.lock takes each stage from the newest
    source that holds it whole (the cut file's complete part, else the backup)."""
    lock, backup = (work / "dvc.lock").read_text(), (work / detrepo.LOCK_BACKUP).read_text()  # n=0, n=1
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    out = str(work / "out")  # an rwlock as DVC writes it while `dvc repro` (now dead) holds the stage locks
    rw = json.dumps({"read": {str(work / "gen.py"): [{"pid": int(dead), "cmd": "dvc repro"}]},
                     "write": {out: {"pid": int(dead), "cmd": "dvc repro"}}})
    new_lock, new_rw = CORRUPTIONS[case](lock, rw)
    (work / "dvc.lock").write_text(new_lock)
    if new_rw is not None:
        (work / ".dvc/tmp/rwlock").write_text(new_rw)
    stuck = run([DVC, "status"], work, check=False)
    assert stuck.returncode != 0, f"DVC works without repair: the case tests nothing\n{stuck.stdout}"

    actions = detrepo.repair(work)
    assert actions and not actions[0].startswith(detrepo.SKIPPED), actions
    assert _dvc_broken(work) is None
    rebuilt = yaml.safe_load((work / "dvc.lock").read_text())["stages"]
    if case == "lock_cut_in_count":  # gen from the cut file (n=0), count from the stale backup (n=1)
        assert rebuilt["gen"] == yaml.safe_load(lock)["stages"]["gen"]
        assert rebuilt["count"] == yaml.safe_load(backup)["stages"]["count"]
        assert (work / detrepo.LOCK_CORRUPT).read_text() == new_lock
    elif new_lock != lock:
        assert rebuilt == yaml.safe_load(backup)["stages"]
    _assert_reproduced(work, 0)


def test_repair_leaves_a_live_dvc_alone(work):
    """While ``dvc repro`` runs a stage (repository lock given up, stage locks in the rwlock), `repair` changes
    nothing, even when the rwlock is unreadable: it finds the live DVC process. After ``kill -9`` of that run,
    `repair` releases its stage locks and removes its temporaries; ``dvc repro`` then works."""
    dvc_yaml = (work / "dvc.yaml").read_text()
    stages = yaml.safe_load(dvc_yaml)
    stages["stages"]["gen"]["cmd"] = "python -c 'import time; time.sleep(120)'"
    (work / "dvc.yaml").write_text(yaml.safe_dump(stages, sort_keys=False))
    _set_n(work, 5)
    proc = subprocess.Popen([DVC, "repro", "-q", "gen"], cwd=work, env=stage_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not [c for c in psutil.Process(proc.pid).children(recursive=True) if "sleep" in " ".join(c.cmdline())]:
            assert proc.poll() is None and time.monotonic() < deadline, "the stage did not start"
            time.sleep(0.2)
        temp = work / ".out.tmp-livestage"  # what a running stage's atomic_dir looks like
        temp.mkdir()
        rwlock = (work / ".dvc/tmp/rwlock").read_text()
        assert str(proc.pid) in rwlock
        actions = detrepo.repair(work)
        assert len(actions) == 1 and actions[0].startswith(detrepo.SKIPPED) and str(proc.pid) in actions[0], actions
        (work / ".dvc/tmp/rwlock").write_text(rwlock[:10])  # unreadable: only the process scan can tell
        actions = detrepo.repair(work)
        assert len(actions) == 1 and actions[0].startswith(detrepo.SKIPPED) and str(proc.pid) in actions[0], actions
        assert (work / ".dvc/tmp/rwlock").read_text() == rwlock[:10] and temp.is_dir()
        (work / ".dvc/tmp/rwlock").write_text(rwlock)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    actions = detrepo.repair(work)
    assert any("stage locks of killed DVC processes" in a for a in actions), actions
    assert any(".out.tmp-livestage" in a for a in actions) and not temp.exists(), actions
    (work / "dvc.yaml").write_text(dvc_yaml)
    _assert_reproduced(work, 5)


@pytest.mark.parametrize("rwlock_age_s", [0, 3600])
def test_repair_tells_a_reused_pid_from_the_dvc_that_wrote_the_rwlock(work, rwlock_age_s):
    """An rwlock naming a live PID blocks `repair` while that process may be its writer; a process started
    after the rwlock was last written (an hour ago here) cannot be, so its PID was reused: the lock is released."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        rwlock = work / ".dvc/tmp/rwlock"
        rwlock.write_text(json.dumps({"write": {str(work / "out"): {"pid": other.pid, "cmd": "dvc repro"}}}))
        written = time.time() - rwlock_age_s
        os.utime(rwlock, (written, written))
        actions = detrepo.repair(work)
    finally:
        other.kill()
        other.wait()
    if rwlock_age_s == 0:
        assert len(actions) == 1 and actions[0].startswith(detrepo.SKIPPED) and str(other.pid) in actions[0]
        assert rwlock.exists()
    else:
        assert any("stage locks of killed DVC processes" in a for a in actions) and not rwlock.exists(), actions


def test_repair_finds_every_stage_temporary_by_the_one_rule(tmp_path):
    """The temporaries the stages leave when killed follow `detpipe.core.files.TEMP_NAME`, so `stage_temporaries`
    finds them: an atomic output's ``.<name>.tmp-*``, a replaced output's ``.<name>.old-<pid>``, download's
    ``.raw.fetch-*`` and export's staging folder (which repair never found while it was ``.export-staging``)."""
    from detpipe.core.files import temp_prefix

    shutil.copyfile(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    left = [tmp_path / "models" / f"{temp_prefix(tmp_path / 'models' / 'export')}4242",
            tmp_path / "data" / f"{temp_prefix(tmp_path / 'data' / 'cache')}abc_1",
            tmp_path / "data" / f"{temp_prefix(tmp_path / 'data' / 'arrow', 'old')}4242",
            tmp_path / "data" / f"{temp_prefix(tmp_path / 'data' / 'raw', 'fetch')}x9"]
    for path in left:
        path.mkdir(parents=True)
    (tmp_path / "models" / ".export-staging").mkdir()       # not a temporary name: a user's folder stays
    assert detrepo.stage_temporaries(tmp_path) == sorted(left)
