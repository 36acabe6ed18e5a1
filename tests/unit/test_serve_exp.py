"""``POST /admin/reload {"model": "exp:<name>"}``'s fetch (issue 49.4): `detpipe.serve.served.fetch_experiment_model`
reads ``models/model.onnx`` of a revision of a real (tiny) git + DVC repository with ``dvc.api.open``, as the
train stage's ``train.weights: exp:<name>`` reads ``models/model.pt``. The server's reload then loads the copy like
any model file (tests/stages/test_serve.py::test_reload_under_load_answers_every_request)."""
from __future__ import annotations

import sys

import pytest

from detpipe.core.errors import StageError
from detpipe.serve.served import fetch_experiment_model
from support.procs import run


def test_exp_model_is_read_from_the_revision(tmp_path, monkeypatch):
    """Tag ``v1`` tracks ``models/model.onnx`` (``dvc add``; then the working copy changes): ``exp:v1`` gives v1's
    bytes, copied into the destination folder (nothing else left there); a revision that does not exist and one
    without the file are one-line errors naming the revision."""
    repo = tmp_path / "repo"
    (repo / "models").mkdir(parents=True)
    run(["git", "init", "-q", "-b", "main"], repo)
    run([sys.executable, "-m", "dvc", "init", "-q"], repo)
    run(["git", "commit", "-qm", "dvc init"], repo)
    run(["git", "tag", "empty"], repo)
    (repo / "models/model.onnx").write_bytes(b"the v1 model bytes")
    run([sys.executable, "-m", "dvc", "add", "-q", "models/model.onnx"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "model v1"], repo)
    run(["git", "tag", "v1"], repo)
    (repo / "models/model.onnx").write_bytes(b"a newer working copy")
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")

    dest = tmp_path / "fetched"
    got = fetch_experiment_model("v1", dest, repo=str(repo))
    assert got.read_bytes() == b"the v1 model bytes" and got.parent == dest and got.suffix == ".onnx"
    assert [p.name for p in dest.iterdir()] == [got.name]
    with pytest.raises(StageError, match=r"^exp:nope: cannot read models/model.onnx: ") as e:
        fetch_experiment_model("nope", dest, repo=str(repo))
    assert "\n" not in str(e.value)
    with pytest.raises(StageError, match=r"^exp:empty: the revision has no models/model.onnx"):
        fetch_experiment_model("empty", dest, repo=str(repo))
    with pytest.raises(StageError, match="needs an experiment, branch or tag name"):
        fetch_experiment_model("", dest, repo=str(repo))
