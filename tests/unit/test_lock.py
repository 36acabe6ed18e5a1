"""Lock file honesty: the committed dvc.lock matches the committed code, params and metrics.

``dvc status`` on a fresh clone of the commit under test (``detpipe.orchestration.repair.lock_mismatches``): a stage whose code,
params or committed outputs differ from what dvc.lock records fails CI with the fix to apply. The same check on a
tiny pipeline shows it passing when dvc.lock matches and failing when a stage's code, a param or a committed
metric changes without ``dvc repro``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from support.procs import run

from detpipe.orchestration.repair import lock_mismatches

REPO = Path(__file__).resolve().parents[2]
DVC = str(Path(sys.executable).parent / "dvc")
GIT_USER = ["-c", "user.name=detpipe-test", "-c", "user.email=test@example.invalid"]


def _fresh_clone(repo: Path, dest: Path) -> Path:
    """A clone of ``repo``'s HEAD commit (committed files only: DVC-cached outputs are absent, as in CI)."""
    head = run(["git", "rev-parse", "HEAD"], repo).stdout.strip()
    run(["git", "clone", "-q", "--shared", "--no-checkout", str(repo), str(dest)], repo)
    run(["git", "checkout", "-q", head], dest)
    return dest


def _mismatch_message(found: list[str]) -> str:
    return ("the committed dvc.lock does not match the committed code and params: run `dvc repro` and commit "
            "dvc.lock with its metrics and plots.\n" + "\n".join(found))


def test_committed_lock_matches_code_and_params(tmp_path):
    """The real check CI runs on this repository's committed tree."""
    found = lock_mismatches(_fresh_clone(REPO, tmp_path / "clone"))
    assert found == [], _mismatch_message(found)


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory) -> Path:
    """A committed two-stage pipeline whose dvc.lock matches: ``make`` (code make.py, param ``k``, cached output
    ``data.txt``) -> ``score`` (code score.py, committed ``cache: false`` metric ``score.json``)."""
    root = tmp_path_factory.mktemp("lock") / "repo"
    root.mkdir()
    (root / "make.py").write_text('import yaml\nk = yaml.safe_load(open("params.yaml"))["k"]\n'
                                  'open("data.txt", "w").write(str(k) * 100)\n')
    (root / "score.py").write_text('import json\njson.dump({"len": len(open("data.txt").read())}, '
                                   'open("score.json", "w"))\n')
    (root / "params.yaml").write_text("k: 3\n")
    stages = {"make": {"cmd": "python make.py", "deps": ["make.py"], "params": ["k"], "outs": ["data.txt"]},
              "score": {"cmd": "python score.py", "deps": ["score.py", "data.txt"],
                        "metrics": [{"score.json": {"cache": False}}]}}
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    for cmd in (["git", "init", "-q"], [DVC, "init", "-q"], [DVC, "config", "core.analytics", "false"],
                [DVC, "repro", "-q"], ["git", "add", "-A"], ["git", *GIT_USER, "commit", "-qm", "pipeline"]):
        run(cmd, root)
    return root


CHANGES = {  # committed without `dvc repro`: (file, new text), the path the mismatch must name
    "matches": (None, None),
    "code": (("make.py", "# a change\n"), "make.py"),
    "param": (("params.yaml", "k: 4\n"), "params.yaml:k"),
    "metric": (("score.json", '{"len": 7}'), "score.json"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_lock_check_fails_on_a_change_committed_without_repro(tiny_repo, tmp_path, change):
    """A clone of the committed pipeline passes; a commit that changes a stage's code, a param or a committed
    metric without ``dvc repro`` fails, naming what changed (the broken variants)."""
    edit, named = CHANGES[change]
    work = _fresh_clone(tiny_repo, tmp_path / "work")
    if edit is not None:
        name, text = edit
        path = work / name
        path.write_text(path.read_text() + text if name.endswith(".py") else text)
        run(["git", *GIT_USER, "commit", "-qam", f"change {name}"], work)
    found = lock_mismatches(_fresh_clone(work, tmp_path / "clone"))
    if named is None:
        assert found == [], found
    else:
        assert found and all(named in f for f in found), found
