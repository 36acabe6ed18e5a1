"""`detpipe.orchestration.remotes.push_partial` while the training writes and prunes checkpoints (a race measured in CI: the
checkpoints were listed before the snapshot worktree existed, all of them were pruned meanwhile, and a partial
experiment with an empty ``checkpoints/`` was pushed as "finished stages").

Everything is real: a git+DVC repository in a temporary folder with a ``train`` stage like the project's (outputs
``models/model.pt`` and ``checkpoints``, a dependency recorded only in ``dvc.lock``), a local-folder DVC remote,
a bare git repository as ``origin``, `detpipe.orchestration.remotes.check` giving the `Remotes`. A thread plays
`detpipe.engine.hooks.CheckpointHook` at its most aggressive: a checkpoint every couple of milliseconds (temporary file
+ ``os.replace``), all but the newest deleted at once (``keep_last`` 1). Each checkpoint's bytes name it, so a
pushed file is checked to be the one its name says.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from detpipe.engine.checkpoints import checkpoint_path, list_checkpoints
from detpipe.orchestration import remotes as rm
from detpipe.orchestration import workspace
from support.procs import run as run_cmd

REPO = Path(__file__).resolve().parents[2]
CKPT_RE = re.compile(r"^ckpt-(\d{7})\.pt$")
log = logging.getLogger("test_push_race")


# ----------------------------------------------------------------------------------------- the training

def payload(name: str) -> bytes:
    """The bytes of checkpoint ``name``: its name, repeated (a pushed file must be the one it is named)."""
    return (name + "\n").encode() * 64


def ckpt_names(directory: Path) -> list[str]:
    """Checkpoint names in ``directory``, oldest first (`detpipe.engine.checkpoints.list_checkpoints`)."""
    return [p.name for p in list_checkpoints(directory)]


class Training:
    """Writes ``ckpt-NNNNNNN.pt`` into ``directory`` as `detpipe.engine.hooks.CheckpointHook` does (temporary file
    beside it, then rename) and deletes all but the newest ``keep_last`` after each one. As a context manager:
    one checkpoint at once, then one every ``period_s`` from a thread until the block ends."""

    def __init__(self, directory: Path, keep_last: int = 1, period_s: float = 0.002):
        self.directory, self.keep_last, self.period_s = directory, keep_last, period_s
        self.directory.mkdir(parents=True, exist_ok=True)
        done = [int(CKPT_RE.match(n).group(1)) for n in ckpt_names(directory)]
        self.iter = max(done, default=0)
        self.written = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> str:
        """Write the next checkpoint, prune the older ones; its name."""
        self.iter += 1
        name = checkpoint_path(self.directory, self.iter).name
        tmp = self.directory / f".{name}.tmp-{os.getpid()}"
        tmp.write_bytes(payload(name))
        os.replace(tmp, self.directory / name)
        for old in ckpt_names(self.directory)[:-self.keep_last]:
            (self.directory / old).unlink(missing_ok=True)
        self.written += 1
        return name

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.step()

    def __enter__(self) -> Training:
        self.step()
        self._thread = threading.Thread(target=self._loop, name="fake-checkpoint-hook", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------------------------------- the checks

def snapshot_problems(linked: list[str], folder: Path) -> list[str]:
    """What is wrong with a snapshot of checkpoints ``linked`` into ``folder`` (empty: nothing)."""
    if not linked:
        return [f"{folder}: no checkpoint linked"]
    problems = []
    for name in linked:
        path = folder / name
        if not CKPT_RE.match(name):
            problems.append(f"{name}: not a checkpoint name")
        elif not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_bytes() != payload(name):
            problems.append(f"{path}: holds another checkpoint's bytes")
    return problems


def git(cwd: Path, *args: str) -> str:
    return run_cmd(["git", *args], cwd).stdout


def remote_sha(origin: Path, ref: str) -> str | None:
    got = subprocess.run(["git", "rev-parse", "-q", "--verify", ref], cwd=origin, capture_output=True, text=True)
    return got.stdout.strip() or None


def remote_problems(origin: Path, sha: str, remotes: rm.Remotes) -> list[str]:
    """What is wrong with partial experiment commit ``sha`` on the git remote ``origin`` as the push of a
    running training (empty: nothing): its message must name a checkpoint, its ``dvc.lock`` must record a
    non-empty ``checkpoints/``, and the DVC remote must hold that folder with each file's right bytes."""
    problems = []
    message = git(origin, "log", "-1", "--format=%B", sha)
    if "finished stages" in message:
        problems.append(f"commit message says 'finished stages': {message.strip()}")
    named = re.search(r"checkpoints up to (ckpt-\d{7}\.pt)", message)
    if not named:
        problems.append(f"commit message names no checkpoint: {message.strip()}")
    lock = yaml.safe_load(git(origin, "show", f"{sha}:dvc.lock"))
    outs = {o["path"]: o for o in (lock["stages"].get("train") or {}).get("outs", [])}
    entry = outs.get("checkpoints") or {}
    md5 = str(entry.get("md5", ""))
    if not md5.endswith(".dir"):
        return problems + [f"dvc.lock records no checkpoints/ folder (train outs: {sorted(outs)})"]
    if not entry.get("nfiles"):
        problems.append(f"dvc.lock records an empty checkpoints/ (nfiles {entry.get('nfiles')})")
    manifest = Path(remotes.uri(md5))
    if not manifest.is_file():
        return problems + [f"checkpoints/ ({md5}) is not on the DVC remote"]
    files = {e["relpath"]: e["md5"] for e in json.loads(manifest.read_text())}
    if not files:
        problems.append("the DVC remote's checkpoints/ is empty")
    for rel, h in files.items():
        obj = Path(remotes.uri(h))
        if not obj.is_file() or obj.read_bytes() != payload(rel):
            problems.append(f"checkpoints/{rel}: not on the DVC remote with its bytes")
    if named and named.group(1) not in files:
        problems.append(f"{named.group(1)} (named in the message) is not in the pushed checkpoints/ {sorted(files)}")
    return problems


# -------------------------------------------------------------------------------------------- link helper

def test_link_checkpoints_while_pruned(tmp_path):
    """Against a folder where a checkpoint appears every ~2 ms and all but the newest are deleted, every call
    (hundreds, over at least 200 checkpoints written) links at least one checkpoint with its own bytes, and one
    at least as new as the newest before the call."""
    src = tmp_path / "checkpoints"
    calls = 0
    with Training(src) as training:
        deadline = time.monotonic() + 20.0
        while (training.written < 200 or calls < 200) and time.monotonic() < deadline:
            newest_before = ckpt_names(src)[-1:]
            dest = tmp_path / "snaps" / str(calls)
            linked = rm.link_checkpoints(src, dest)
            assert snapshot_problems(linked, dest) == []
            assert sorted(os.listdir(dest)) == linked
            assert linked[-1] >= max(newest_before, default="")
            calls += 1
            time.sleep(0.0005)
        written = training.written
    assert written >= 200 and calls >= 200, f"{calls} snapshots of {written} checkpoints in 20 s"


def test_link_checkpoints_lists_again_when_all_listed_vanished(tmp_path, monkeypatch):
    """Deterministic: right after each listing the training writes a newer checkpoint and deletes every older
    one, so every listed file is gone when its link is tried. The second listing finds the newer one and it is
    linked; when that happens at every listing, [] after exactly ``attempts`` listings."""
    training = Training(tmp_path / "checkpoints")
    training.step()
    real = rm._checkpoint_files
    listings = []

    def listed_then_pruned(directory, prune_at=(1,)):
        files = real(directory)
        listings.append([p.name for p in files])
        if len(listings) in prune_at:
            training.step()
        return files

    monkeypatch.setattr(rm, "_checkpoint_files", listed_then_pruned)
    assert rm.link_checkpoints(training.directory, tmp_path / "a") == ["ckpt-0000002.pt"]
    assert listings == [["ckpt-0000001.pt"], ["ckpt-0000002.pt"]]
    assert snapshot_problems(["ckpt-0000002.pt"], tmp_path / "a") == []

    listings.clear()
    monkeypatch.setattr(rm, "_checkpoint_files", lambda d: listed_then_pruned(d, prune_at=range(1, 100)))
    assert rm.link_checkpoints(training.directory, tmp_path / "b", attempts=4) == []
    assert len(listings) == 4 and os.listdir(tmp_path / "b") == []


def old_list_then_link(src: Path, dest: Path, timeout_s: float = 10.0) -> list[str]:
    """The algorithm `push_partial` had: list, then (git worktree add: a second or more) link what was listed,
    a vanished file skipped. The wait lasts until the training has pruned every listed file."""
    listed = sorted(src.glob("ckpt-*.pt"))
    deadline = time.monotonic() + timeout_s
    while any(p.exists() for p in listed) and time.monotonic() < deadline:
        time.sleep(0.005)
    dest.mkdir(parents=True, exist_ok=True)
    linked = []
    for ckpt in listed:
        try:
            os.link(ckpt, dest / ckpt.name)
        except FileNotFoundError:
            continue
        linked.append(ckpt.name)
    return linked


def test_list_then_link_later_is_flagged(tmp_path):
    """The check above can fail: the old order (list, wait for the worktree, link) under the same training
    links nothing and is flagged; `link_checkpoints` on the same folder right after is not."""
    src = tmp_path / "checkpoints"
    with Training(src):
        old = old_list_then_link(src, tmp_path / "old")
        new = rm.link_checkpoints(src, tmp_path / "new")
    assert old == []
    assert snapshot_problems(old, tmp_path / "old") == [f"{tmp_path / 'old'}: no checkpoint linked"]
    assert snapshot_problems(new, tmp_path / "new") == []


def test_link_checkpoints_gives_up_on_an_emptied_folder(tmp_path):
    """Nothing to link (no folder, or an empty one): [] after the bounded listings, no error."""
    assert rm.link_checkpoints(tmp_path / "none", tmp_path / "a") == []
    (tmp_path / "empty").mkdir()
    assert rm.link_checkpoints(tmp_path / "empty", tmp_path / "b", attempts=3) == []


# ---------------------------------------------------------------------------------------- real remotes

DVC_YAML = """\
stages:
  prepare:
    cmd: python prepare.py
    deps:
      - prepare.py
    outs:
      - data
  train:
    cmd: python train.py
    deps:
      - train.py
      - data
    params:
      - train.lr
    outs:
      - models/model.pt
      - checkpoints:
          persist: true
"""
PREPARE = """\
from pathlib import Path
Path("data").mkdir(exist_ok=True)
Path("data/images.txt").write_text("a b c\\n")
"""


class PushRaceTeam:
    def __init__(self, ws: Path, origin: Path, run: rm.Run):
        self.ws, self.origin, self.run = ws, origin, run

    def run_named(self, name: str) -> rm.Run:
        return rm.Run(self.run.remotes, name, self.run.run_id)

    def ref(self, run: rm.Run) -> str:
        baseline = git(self.ws, "rev-parse", "HEAD").strip()
        return f"refs/exps/{baseline[:2]}/{baseline[2:]}/{run.name}"

    def fresh_checkpoints(self) -> Path:
        ckpts = self.ws / "checkpoints"
        for p in ckpts.glob("*"):
            p.unlink()
        return ckpts


@pytest.fixture(scope="module")
def push_race_team(tmp_path_factory):
    """The workspace of a run (a git+DVC repository whose ``prepare`` stage ran), its remotes and a `Run`."""
    tmp = tmp_path_factory.mktemp("race")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"DVC_NO_ANALYTICS": "1", "DVC_SITE_CACHE_DIR": str(tmp / "dvc-site"),
                     "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
                     "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost",
                     "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
                     # python -m detpipe.orchestration.commit_partial in the snapshot worktree; `python` in dvc.yaml commands
                     "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                     "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}.items():
            mp.setenv(k, v)
        ws, origin, storage = tmp / "ws", tmp / "origin.git", tmp / "dvc-storage"
        ws.mkdir()
        storage.mkdir()
        dvc = [sys.executable, "-m", "dvc"]
        for cmd in (["git", "init", "-q", "-b", "main"], [*dvc, "init", "-q"],
                    [*dvc, "remote", "add", "-d", "team", str(storage)],
                    ["git", "init", "-q", "--bare", str(origin)], ["git", "remote", "add", "origin", str(origin)]):
            run_cmd(cmd, ws)
        (ws / "dvc.yaml").write_text(DVC_YAML)
        (ws / "params.yaml").write_text("train:\n  lr: 0.01\n")
        (ws / "prepare.py").write_text(PREPARE)
        (ws / "train.py").write_text("raise SystemExit('not run here')\n")
        run_cmd([*dvc, "repro", "-q", "prepare"], ws)
        run_cmd(["git", "add", "-A"], ws)
        run_cmd(["git", "commit", "-qm", "baseline"], ws)
        flow_run = rm.Run(rm.check(ws), "race", "run-0123")
        assert flow_run.remotes.dvc_url == str(storage)
        yield PushRaceTeam(ws, origin, flow_run)


def test_push_partial_while_training_prunes(push_race_team):
    """Three pushes while checkpoints appear every ~2 ms and all but the newest are deleted: each pushes a
    commit whose dvc.lock records a non-empty checkpoints/ that is on the DVC remote, with the newest one
    linked named in its message; never 'finished stages'."""
    run = push_race_team.run_named("race-live")
    pushed = []
    with Training(push_race_team.fresh_checkpoints()) as training:
        for _ in range(3):
            ref = rm.push_partial(push_race_team.ws, run, log)
            assert ref == push_race_team.ref(run)
            pushed.append(remote_sha(push_race_team.origin, ref))
        written = training.written
    assert written > 100, f"the training thread wrote only {written} checkpoints during the pushes"
    assert len(set(pushed)) == 3
    named = []
    for sha in pushed:
        assert remote_problems(push_race_team.origin, sha, push_race_team.run.remotes) == []
        message = git(push_race_team.origin, "log", "-1", "--format=%B", sha)
        named.append(re.search(r"up to (ckpt-\d{7}\.pt)", message)[1])
    assert named == sorted(named) and len(set(named)) == 3, named
    assert not (push_race_team.ws.parent / "ws.push").exists()


def test_push_partial_links_after_the_worktree_exists(push_race_team, monkeypatch):
    """The window the bug lived in, made deterministic: while the snapshot worktree is created, the training
    writes a newer checkpoint and deletes every one that existed before. The push takes the newer one (the
    old code linked none and pushed an empty checkpoints/ as 'finished stages')."""
    run = push_race_team.run_named("race-window")
    training = Training(push_race_team.fresh_checkpoints())
    first = training.step()
    real = workspace.add_worktree
    during = []

    def add_worktree(repo, path, rev="HEAD"):
        real(repo, path, rev)
        during.append(training.step())
        assert first not in ckpt_names(training.directory)

    monkeypatch.setattr(workspace, "add_worktree", add_worktree)
    ref = rm.push_partial(push_race_team.ws, run, log)
    sha = remote_sha(push_race_team.origin, ref)
    assert remote_problems(push_race_team.origin, sha, push_race_team.run.remotes) == []
    assert f"checkpoints up to {during[0]}" in git(push_race_team.origin, "log", "-1", "--format=%B", sha)


def test_all_checkpoints_vanish_nothing_pushed(push_race_team, monkeypatch, caplog):
    """Every checkpoint deleted while the worktree is created: `push_partial` raises `CheckpointsVanished` (one
    line naming the folder) and the experiment on the remote stays the earlier, good one; under `keeping` the
    error is logged, the run's own error goes on, and no 'finished stages' push replaces the checkpoints."""
    run = push_race_team.run_named("race-vanish")
    training = Training(push_race_team.fresh_checkpoints())
    training.step()
    good = remote_sha(push_race_team.origin, rm.push_partial(push_race_team.ws, run, log))
    assert remote_problems(push_race_team.origin, good, push_race_team.run.remotes) == []
    training.step()
    real = workspace.add_worktree

    def add_worktree(repo, path, rev="HEAD"):
        real(repo, path, rev)
        for p in list_checkpoints(training.directory):
            p.unlink()

    monkeypatch.setattr(workspace, "add_worktree", add_worktree)
    with pytest.raises(rm.CheckpointsVanished, match=r"checkpoints: every checkpoint file was deleted") as e:
        rm.push_partial(push_race_team.ws, run, log)
    assert "\n" not in str(e.value) and str(push_race_team.ws / "checkpoints") in str(e.value)
    assert remote_sha(push_race_team.origin, push_race_team.ref(run)) == good

    training.step()
    with caplog.at_level(logging.INFO, logger=log.name):
        with pytest.raises(RuntimeError, match="the run's own error"):
            with rm.keeping(push_race_team.ws, run, {"prepare": "ran"}, log):
                raise RuntimeError("the run's own error")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("could not push the run's checkpoints" in m for m in errors), errors
    assert remote_sha(push_race_team.origin, push_race_team.ref(run)) == good
    assert not (push_race_team.ws.parent / "ws.push").exists()


def test_remote_check_flags_a_push_without_checkpoints(push_race_team):
    """The remote check can fail: a real partial push without checkpoints (``training=False``, the
    'finished stages' commit the bug produced) is flagged."""
    run = push_race_team.run_named("race-no-ckpt")
    sha = remote_sha(push_race_team.origin, rm.push_partial(push_race_team.ws, run, log, training=False))
    problems = remote_problems(push_race_team.origin, sha, push_race_team.run.remotes)
    assert any("finished stages" in p for p in problems), problems
    assert any("names no checkpoint" in p for p in problems), problems
    assert any("no checkpoints/ folder" in p for p in problems), problems
