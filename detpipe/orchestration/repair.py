"""The DVC repository after a kill: find and repair what a killed DVC or stage left behind; check dvc.lock.

DVC 3.67 rewrites two files in place (treeverse/dvc#7615), so a kill at the wrong moment leaves them cut short
and every later ``dvc`` command fails until they are repaired by hand:

- ``.dvc/tmp/rwlock``: JSON ``{"read": {path: [{"pid", "cmd"}]}, "write": {path: {"pid", "cmd"}}}`` naming the
  commands that hold each stage's deps and outs. ``dvc/rwlock.py::_edit_rwlock`` truncates it (``open("w")``)
  and ``json.dump``\\ s the new content each time a command takes or gives back its stage locks, several times per
  stage (under ``.dvc/tmp/rwlock.lock``). Cut short: "Unable to read RWLock-file ... JSON structure is corrupted".
- ``dvc.lock``: YAML rewritten with ``open("w+")`` and a ruamel dump after each stage
  (``dvc/dvcfile.py::Lockfile.dump_stages`` -> ``utils/serialize/_common.py::_dump_data``), under the
  repository lock ``.dvc/tmp/lock``. Cut short: "'./dvc.lock' validation failed" or a YAML error.

The repository lock is a ``zc.lockfile`` (an ``fcntl`` lock the kernel drops when its process dies; DVC gives it
up while a stage's command runs, ``dvc/stage/decorators.py::unlocked_repo``); the rwlock names the PIDs of the
commands that hold stage locks. `repair` never touches anything while a DVC command or a stage runs in the
repository: see `live_processes`.

It reads dvc.yaml and dvc.lock itself, with DVC's YAML reader and lock file schema (``dvc.utils.serialize.parse_yaml``,
``dvc.schema.COMPILED_LOCKFILE_SCHEMA``), not through ``dvc.repo.Repo`` as the rest of ``detpipe.orchestration`` does: the
Repo's index reads dvc.lock together with dvc.yaml and refuses a cut-short one, which is what repair must mend.

Stages write their outputs through ``detpipe.core.files`` (a temporary path beside the output, then a rename), so a
killed stage leaves ``.<name>.tmp-*`` (``atomic_dir``, ``atomic_write_bytes``), ``.<name>.old-<pid>``
(``atomic_dir`` replacing an output) or ``.<name>.fetch-*`` (download) beside its outputs; `repair` removes them.

Command line (plain ``dvc`` users, after a killed run)::

    python -m detpipe.orchestration.repair repair [--root .]     # exit 0: repository usable; 1: a DVC process is running
    python -m detpipe.orchestration.repair check-lock [--root .] # exit 1 when dvc.lock does not match code and params
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil

from detpipe.core.errors import StageError, run_program
from detpipe.core.files import temp_of
from detpipe.orchestration.processes import dvc, git

log = logging.getLogger("detpipe.orchestration.repair")

LOCK_BACKUP = Path(".dvc/tmp/dvc.lock.backup")    # the last dvc.lock `repair` found valid
LOCK_CORRUPT = Path(".dvc/tmp/dvc.lock.corrupt")  # the last cut-short dvc.lock `repair` replaced
RWLOCK = Path(".dvc/tmp/rwlock")
SKIPPED = "skipped"                               # first word of the action when a live process blocks repair


def _ancestors() -> set[int]:
    me = psutil.Process()
    return {me.pid} | {p.pid for p in me.parents()}


def _alive(pid: int, written_at: float | None = None) -> bool:
    """Whether ``pid`` runs (a zombie does not). With ``written_at`` (the mtime of the file that names the PID,
    seconds since the epoch), a process started more than 1 s after it cannot be the one named: a reused PID."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return written_at is None or proc.create_time() <= written_at + 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process: assume it is the one named
        return True


def _is_pipeline_command(cmdline: list[str]) -> bool:
    """``dvc ...`` (console script or ``-m dvc``), ``python -m stages.<name>``, torchrun and its workers."""
    names = [os.path.basename(a) for a in cmdline[:2]]
    if "dvc" in names or "torchrun" in names:
        return True
    return any(a == "-m" and (b == "dvc" or b.startswith("stages.") or b == "torch.distributed.run")
               for a, b in zip(cmdline, cmdline[1:]))


def _rwlock_holders(root: Path) -> tuple[list[dict] | None, str | None]:
    """(every {"pid", "cmd"} in the rwlock, None), ([], None) without one, or (None, why it is unreadable)."""
    path = root / RWLOCK
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return [], None
    try:
        lock = json.loads(text)
        infos = list(lock.get("write", {}).values())
        infos += [info for readers in lock.get("read", {}).values() for info in readers]
        return [{"pid": int(i["pid"]), "cmd": str(i["cmd"])} for i in infos], None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        return None, f"{len(text.encode())} bytes, not the JSON DVC writes ({type(e).__name__}: {e})"


def live_processes(root: Path | str) -> list[str]:
    """Live processes that may be writing the repository at ``root``, one description each.

    A process counts when the rwlock names its PID, it runs (not a zombie) and it started before the rwlock was
    last written (else the PID was reused); or when it is not this process or one of its ancestors, its
    working directory is inside ``root``, and it runs ``dvc``, ``python -m stages.<name>`` or torchrun. A
    process whose working directory cannot be read (another user's) counts when its command line is one of
    those.
    """
    root = Path(root).resolve()
    found = []
    holders, _ = _rwlock_holders(root)
    try:
        written_at = (root / RWLOCK).stat().st_mtime
    except FileNotFoundError:
        written_at = None
    for info in holders or []:
        if _alive(info["pid"], written_at):
            found.append(f"PID {info['pid']} ({info['cmd']}) holds DVC stage locks in {RWLOCK}")
    mine = _ancestors()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["pid"] in mine or not _is_pipeline_command(cmdline) or not _alive(proc.info["pid"]):
            continue
        try:
            cwd = Path(proc.cwd()).resolve()
            inside = cwd == root or root in cwd.parents
        except psutil.AccessDenied:
            inside = True
        except psutil.Error:  # gone or a zombie
            continue
        if inside:
            found.append(f"PID {proc.info['pid']} ({' '.join(cmdline)[:200]}) runs in {root}")
    return found


@contextlib.contextmanager
def _dvc_locks(root: Path) -> Iterator[bool]:
    """Hold DVC's repository lock and rwlock guard (the locks DVC takes to write dvc.lock and the rwlock), with
    DVC's own lock classes and its ``core.hardlink_lock`` setting; yields False when a live process holds one
    (after DVC's usual 3 s of retries)."""
    from dvc.config import Config
    from dvc.lock import LockError, make_lock

    tmp_dir = root / ".dvc" / "tmp"
    tmp_dir.mkdir(exist_ok=True)
    hardlink = bool(Config(dvc_dir=str(root / ".dvc"))["core"].get("hardlink_lock", False))
    locks = [make_lock(str(tmp_dir / name), tmp_dir=str(tmp_dir), hardlink_lock=hardlink)
             for name in ("lock", "rwlock.lock")]
    held = []
    try:
        for lock in locks:
            try:
                lock.lock()
            except LockError:
                break
            held.append(lock)
        yield len(held) == len(locks)
    finally:
        for lock in reversed(held):
            lock.unlock()


def _lockfile_problem(text: str, where: str) -> str | None:
    """Why ``text`` is not a dvc.lock DVC wrote completely (None if it is): DVC's ruamel dump always ends with a
    newline, and DVC reads it with ``parse_yaml`` and validates it with ``COMPILED_LOCKFILE_SCHEMA``."""
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA
    from dvc.utils.serialize import parse_yaml
    from voluptuous import Invalid

    if not text:
        return "empty"
    if not text.endswith("\n"):
        return "cut short (no final newline)"
    try:
        COMPILED_LOCKFILE_SCHEMA(parse_yaml(text, where))
    except Invalid as e:
        return f"fails DVC's lock file schema ({e})"
    except Exception as e:  # YAMLFileCorruptedError and the like
        return f"not valid YAML ({type(e).__name__})"
    return None


def _complete_stages(text: str) -> dict:
    """The stage entries a cut-short dvc.lock still holds whole: DVC dumps ``stages:`` with one key per stage at
    two spaces of indent, so every stage followed by the next stage's key line was written completely."""
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA
    from dvc.utils.serialize import parse_yaml

    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip() == "stages:")
    except StopIteration:
        return {}
    keys = []  # line numbers of the stage keys, and of the next top-level key if any
    for i in range(start + 1, len(lines)):
        if re.match(r"\S", lines[i]):  # the next top-level key: every stage above it is complete
            keys.append(i)
            break
        if re.match(r"  [^ \-#]", lines[i]):
            keys.append(i)
    cut = keys[-1] if keys else len(lines)  # the last stage may be incomplete unless a top-level key follows
    try:
        data = COMPILED_LOCKFILE_SCHEMA(parse_yaml("".join(lines[:cut]), "dvc.lock (complete part)"))
    except Exception:  # noqa: BLE001 - a prefix that does not parse keeps nothing
        return {}
    return dict(data.get("stages") or {})


def _valid_stages(text: str | None, where: str) -> dict:
    from dvc.utils.serialize import parse_yaml

    if text is None or _lockfile_problem(text, where) is not None:
        return {}
    return dict(parse_yaml(text, where).get("stages") or {})


def _git_head_lock(root: Path) -> str | None:
    try:
        proc = git(root, "show", "HEAD:./dvc.lock", check=False, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _repair_lockfile(root: Path) -> list[str]:
    """Keep a copy of a valid dvc.lock; rebuild a cut-short one (see `repair`)."""
    from dvc.utils.serialize import dumps_yaml

    from detpipe.core.files import atomic_write_bytes

    path, backup = root / "dvc.lock", root / LOCK_BACKUP
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    problem = _lockfile_problem(text, str(path))
    if problem is None:
        if not backup.exists() or backup.read_text(encoding="utf-8") != text:
            atomic_write_bytes(backup, text.encode("utf-8"))
            log.debug("kept a copy of dvc.lock in %s", LOCK_BACKUP)
        return []
    stages = _complete_stages(text)
    source = {name: "its complete part" for name in stages}
    backup_text = backup.read_text(encoding="utf-8") if backup.exists() else None
    for label, fallback in ((str(LOCK_BACKUP), backup_text), ("git HEAD:dvc.lock", _git_head_lock(root))):
        for name, entry in _valid_stages(fallback, label).items():
            if name not in stages:
                stages[name], source[name] = entry, label
    shutil.copyfile(path, root / LOCK_CORRUPT)
    atomic_write_bytes(path, dumps_yaml({"schema": "2.0", "stages": stages}).encode("utf-8"))
    by_source: dict[str, list[str]] = {}
    for name, label in source.items():
        by_source.setdefault(label, []).append(name)
    kept = "; ".join(f"{', '.join(names)} from {label}" for label, names in by_source.items()) or "no stage"
    return [f"dvc.lock was left {problem} by a killed DVC; rebuilt with {kept} (a stage it lacks runs again on "
            f"the next dvc repro); the cut-short file is in {LOCK_CORRUPT}"]


def _repair_rwlock(root: Path) -> list[str]:
    """Remove an unreadable rwlock, or one that names only dead PIDs (called with no DVC process alive)."""
    path = root / RWLOCK
    holders, unreadable = _rwlock_holders(root)
    if unreadable:
        os.replace(path, path.with_name("rwlock.corrupt"))
        return [f"{RWLOCK} was {unreadable}, left by a killed DVC; moved to {RWLOCK}.corrupt (no DVC process "
                f"is alive, so no stage lock is held)"]
    if holders:
        path.unlink()
        pids = sorted({h["pid"] for h in holders})
        return [f"{RWLOCK} named {len(holders)} stage locks of killed DVC processes (PIDs "
                f"{', '.join(map(str, pids))}); removed"]
    return []


def _declared_outputs(root: Path) -> list[Path]:
    """Every out, metric and plot path of dvc.yaml's stages (relative to ``root``; templated ones skipped); none
    when dvc.yaml is missing or not YAML. Read by hand (see the module docstring: DVC's index would read dvc.lock
    too, and fail on a cut-short one)."""
    from dvc.utils.serialize import YAMLFileCorruptedError, parse_yaml

    path = root / "dvc.yaml"
    try:
        stages = parse_yaml(path.read_text(encoding="utf-8"), str(path)).get("stages") or {}
    except (OSError, YAMLFileCorruptedError):
        return []
    paths = []
    for stage in stages.values():
        wdir = Path(stage.get("wdir", "."))
        for key in ("outs", "metrics", "plots"):
            for item in stage.get(key) or []:
                for p in [item] if isinstance(item, str) else list(item):
                    if "${" not in p:
                        paths.append(wdir / p)
    return paths


def stage_temporaries(root: Path | str) -> list[Path]:
    """Temporary files and folders of killed stages: names following the temporary-name rule
    (`detpipe.core.files.TEMP_NAME`) beside a declared output.

    In a folder that holds declared outputs (``data/``, ``models/``, ``metrics/``, ...) every such name counts;
    in the repository root only those of a declared output (``.checkpoints.tmp-*``). Does not check whether
    their owner is alive: `repair` does.
    """
    root = Path(root).resolve()
    outputs = [(root / p).resolve() for p in _declared_outputs(root)]
    found = set()
    for parent in {o.parent for o in outputs}:
        if not parent.is_dir() or not (parent == root or root in parent.parents):
            continue
        names = {o.name for o in outputs if o.parent == parent}
        for entry in parent.iterdir():
            owner = temp_of(entry.name)
            if owner and (parent != root or owner in names):
                found.add(entry)
    return sorted(found)


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir() or f.is_symlink())


def repair(root: Path) -> list[str]:
    """Make the DVC repository at ``root`` usable after a kill at any moment, and return the actions taken.

    Nothing is changed while a DVC command or a stage runs in the repository (`live_processes`) or while a
    live process holds DVC's repository lock: the result is then one action starting with ``"skipped"``.
    Otherwise, holding DVC's repository lock and rwlock guard (a few milliseconds; DVC waits up to 3 s):

    - ``.dvc/tmp/rwlock`` that is not valid JSON (cut short) is moved to ``.dvc/tmp/rwlock.corrupt``; one that
      names only dead PIDs is removed (DVC would drop those entries itself, with a warning).
    - a valid ``dvc.lock`` is copied to ``.dvc/tmp/dvc.lock.backup`` (the flow calls `repair` before each
      stage, so the copy is at most one stage old). A cut-short one (empty, no final newline, not YAML, or
      failing DVC's schema) is rebuilt from the stage entries it still holds whole (the newest), then, for the
      stages it lost, from the backup, then from ``git HEAD:dvc.lock``; stages found nowhere are left out.
      Every entry comes from a dvc.lock DVC wrote, so it records a real run: DVC reruns a stage whose deps,
      params or outs differ from it, and never skips one that needs to run. The cut-short file is kept in
      ``.dvc/tmp/dvc.lock.corrupt``.

    Then the temporaries of killed stages (`stage_temporaries`) listed under the locks are removed.

    Args:
        root: the repository root (the folder holding ``.dvc``).
    Returns:
        one line per action taken (also logged); empty when there was nothing to repair.
    Raises:
        StageError: ``root`` holds no ``.dvc`` folder.
    """
    root = Path(root).resolve()
    if not (root / ".dvc").is_dir():
        raise StageError(f"{root}: not a DVC repository (no .dvc folder)")
    actions: list[str] = []
    busy = live_processes(root)
    if not busy:
        with _dvc_locks(root) as held:
            busy = live_processes(root) if held else ["a live DVC process holds the repository lock .dvc/tmp/lock"]
            if not busy:
                actions += _repair_rwlock(root)
                actions += _repair_lockfile(root)
                temporaries = stage_temporaries(root)
    if busy:
        actions = [f"{SKIPPED}: {'; '.join(busy)}; nothing changed"]
        log.warning("%s", actions[0])
        return actions
    for path in temporaries:
        size = _size(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        actions.append(f"removed {path.relative_to(root)} ({size} bytes), left by a killed stage")
    for action in actions:
        log.info("%s", action)
    return actions


def lock_mismatches(root: Path | str) -> list[str]:
    """Where dvc.lock at ``root`` does not match the code, params and committed outputs, per ``dvc status``.

    Counted: a dep or param that exists and differs from dvc.lock (``modified``) or that dvc.lock lacks
    (``new``), a changed command, a missing stage entry, and an output present in the tree that differs from
    dvc.lock (e.g. committed metrics). Not counted: deps and outs that are absent (in a fresh clone, outputs
    that DVC caches are not checked out), and stages marked always changed.

    Returns:
        one line per mismatch, ``"<stage>: <what> <path>: <status>"``; empty when dvc.lock matches.
    Raises:
        StageError: ``dvc status`` fails (names its error).
    """
    root = Path(root)
    proc = subprocess.run(dvc("status", "--json"), cwd=root, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise StageError(f"{root}: dvc status failed: {proc.stderr.strip()[-2000:]}")
    found = []
    for stage, items in json.loads(proc.stdout or "{}").items():
        for item in items:
            if isinstance(item, str):
                if item != "always changed":
                    found.append(f"{stage}: {item}")
                continue
            for kind, changes in item.items():
                if not isinstance(changes, dict):  # e.g. "changed command": true
                    found.append(f"{stage}: {kind}")
                    continue
                for path, status in changes.items():
                    if isinstance(status, dict):  # params: {file: {name: status}}
                        found += [f"{stage}: {kind} {path}:{name}: {st}" for name, st in status.items()]
                    elif status not in ("deleted", "not in cache"):
                        found.append(f"{stage}: {kind} {path}: {status}")
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m detpipe.orchestration.repair", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, what in (("repair", "repair what a killed DVC or stage left behind"),
                       ("check-lock", "fail when dvc.lock does not match the code and params")):
        sub.add_parser(name, help=what).add_argument("--root", default=".", help="repository root")
    args = parser.parse_args(argv)
    if args.command == "repair":
        actions = repair(Path(args.root))  # each action is logged
        if not actions:
            print("nothing to repair")
        elif actions[0].startswith(SKIPPED):
            sys.exit(1)
    else:
        found = lock_mismatches(args.root)
        if found:
            raise StageError("dvc.lock does not match the code and params (run `dvc repro` and commit "
                             "dvc.lock with its outputs): " + "; ".join(found))
        print("dvc.lock matches the code and params")


if __name__ == "__main__":
    run_program(main)
