"""`detpipe.data.meta`: a ``meta.json`` is read once per process into one object, and read again when it changes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from detpipe.data import meta as meta_mod
from detpipe.core.errors import StageError


def test_meta_json_is_read_once_and_again_when_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "meta.json"
    path.write_text(json.dumps({"label_names": ["a"]}))
    reads = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or real(self))
    first = meta_mod.read_meta(path)
    assert meta_mod.read_meta(str(path)) is first and meta_mod.read_meta_bytes(path) == path.read_bytes()
    assert len([p for p in reads if p == path]) == 2  # one by read_meta, one by this test's own check
    path.write_text(json.dumps({"label_names": ["a", "b"]}))
    os.utime(path, ns=(1, 1))  # another mtime even on a coarse clock
    assert meta_mod.read_meta(path) == {"label_names": ["a", "b"]}
    path.write_text("{broken")
    with pytest.raises(StageError, match=r"meta\.json: not valid JSON"):
        meta_mod.read_meta(path)
    with pytest.raises(StageError, match=r"nothing/meta\.json: not found \(run the convert stage first\)"):
        meta_mod.read_meta(tmp_path / "nothing" / "meta.json", "convert")
