"""Tests of the download stage against real servers on 127.0.0.1: Python's http.server (archives, a
connection dropped mid-file, 404/403/503, a stalled body) and SeaweedFS S3 (``tests/s3server.py``)."""
from __future__ import annotations

import hashlib
import io
import logging
import re
import socket
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections import Counter
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from detpipe.core.errors import StageError
from detpipe.data.archives import extract
from detpipe.data.fetch import fetch, http_fetch
from detpipe.core.files import folder_sha256
from detpipe.data.download import download, download_parts, download_raw
from detpipe.params import Download, DownloadPart, load
from support.pipeline import write_params
from support.procs import run

REPO = Path(__file__).resolve().parents[2]
COCO = REPO / "data" / "coco128"
IMAGES = sorted((COCO / "train2017").glob("*.jpg"))[:3]
FAST = dict(retries=3, timeout_s=5, backoff_s=0.05)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_sha(root: Path) -> str:
    """The manifest hash written out independently of detpipe.data.download (spec of folder_sha256)."""
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    text = "".join(f"{rel}\t{_sha((root / rel).read_bytes())}\n" for rel in rels)
    return _sha(text.encode("utf-8"))


def _sample_files() -> dict[str, bytes]:
    """A few real COCO128 files, keyed by their path inside the archives."""
    files = {f"train2017/{p.name}": p.read_bytes() for p in IMAGES}
    files["annotations/instances_train2017.json"] = (COCO / "annotations/instances_train2017.json").read_bytes()
    return files


def _tar_gz(path: Path, files: dict[str, bytes]) -> bytes:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path.read_bytes()


def _zip(path: Path, files: dict[str, bytes]) -> bytes:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path.read_bytes()


def _assert_tree(root: Path, files: dict[str, bytes]) -> None:
    got = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert sorted(got) == sorted(files)
    for name, data in files.items():
        assert got[name] == data, name


def _leftovers(parent: Path) -> list[str]:
    """Temporary folders of atomic_dir / the fetch staging left beside the output."""
    return [p.name for p in parent.iterdir() if p.name.startswith(".raw.")]


# --------------------------------------------------------------------------------------------- HTTP server

BEHAVIOURS = {"drop", "norange", "stall", "flaky", "down", "forbidden"}


class _Handler(SimpleHTTPRequestHandler):
    """Serves files of ``server.root``. ``/<behaviour>/<name>`` adds a fault on the first request:
    drop (body cut at 1/2, then Range honoured), norange (cut, then Range ignored: 200), stall (1/3 sent,
    then silence for 3 s), flaky (503 once), down (503 always), forbidden (403 always)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        srv = self.server
        path = urlsplit(self.path).path
        rng = self.headers.get("Range")
        with srv.lock:
            srv.log.append((path, rng))
            srv.counts[path] += 1
            n = srv.counts[path]
        behaviour, _, name = path.lstrip("/").partition("/")
        if behaviour not in BEHAVIOURS:
            return super().do_GET()
        if behaviour == "forbidden":
            return self.send_error(403)
        if behaviour == "down" or (behaviour == "flaky" and n == 1):
            return self.send_error(503)
        data = (srv.root / name).read_bytes()
        if n == 1 and behaviour in ("drop", "norange", "stall"):
            cut = len(data) // (3 if behaviour == "stall" else 2)
            srv.sent[path] = cut
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            self.wfile.write(data[:cut])
            self.wfile.flush()
            if behaviour == "stall":
                time.sleep(3)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return None
        start = 0
        if rng and behaviour != "norange":
            start = int(rng.split("=", 1)[1].split("-", 1)[0])
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:])
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass                                    # dropped connections are the point of some routes


@pytest.fixture
def http_server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    srv = _Server(("127.0.0.1", 0), partial(_Handler, directory=str(root)))
    srv.root, srv.log, srv.counts, srv.sent, srv.lock = root, [], Counter(), {}, threading.Lock()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


# --------------------------------------------------------------------------------------------- folder, sha

def test_folder_sha256_matches_the_documented_manifest(tmp_path):
    root = tmp_path / "f"
    (root / "b" / "c").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"alpha")
    (root / "b" / "c" / "d.bin").write_bytes(bytes(range(256)))
    (root / "b" / "z.txt").write_text("zeta")
    (root / "empty").mkdir()
    expected = _sha("".join(f"{rel}\t{_sha(data)}\n" for rel, data in sorted(
        [("a.txt", b"alpha"), ("b/c/d.bin", bytes(range(256))), ("b/z.txt", b"zeta")])).encode())
    assert folder_sha256(root) == expected
    (root / "b" / "z.txt").write_text("zetA")
    assert folder_sha256(root) != expected
    assert folder_sha256(root / "empty") == _sha(b"")


def test_local_folder_copy_and_manifest(tmp_path):
    out = tmp_path / "raw"
    digest = download(str(COCO), out, sha256=_manifest_sha(COCO))
    assert digest == _manifest_sha(COCO) == folder_sha256(out)
    assert (out / "annotations" / "instances_train2017.json").read_bytes() == \
        (COCO / "annotations" / "instances_train2017.json").read_bytes()
    assert len(list((out / "train2017").glob("*.jpg"))) == len(list((COCO / "train2017").glob("*.jpg")))
    assert _leftovers(tmp_path) == []


def test_sha_mismatch_leaves_nothing_and_keeps_previous_output(tmp_path):
    out = tmp_path / "raw"
    with pytest.raises(StageError) as e:
        download(str(COCO), out, sha256="0" * 64)
    msg = str(e.value)
    assert str(COCO) in msg and "0" * 64 in msg and _manifest_sha(COCO) in msg and "\n" not in msg
    assert not out.exists() and _leftovers(tmp_path) == []
    out.mkdir()
    (out / "old.txt").write_text("previous run")
    with pytest.raises(StageError):
        download(str(COCO), out, sha256="f" * 64)
    assert [p.name for p in out.iterdir()] == ["old.txt"] and _leftovers(tmp_path) == []


def test_local_archive_via_file_url_and_single_file(tmp_path):
    files = _sample_files()
    data = _tar_gz(tmp_path / "coco.tgz", files)
    assert download(f"file://{tmp_path / 'coco.tgz'}", tmp_path / "raw", sha256=_sha(data)) == _sha(data)
    _assert_tree(tmp_path / "raw", files)
    single = tmp_path / "notes.json"
    single.write_bytes(b'{"a": 1}')
    download(str(single), tmp_path / "raw2", sha256=_sha(b'{"a": 1}'))
    _assert_tree(tmp_path / "raw2", {"notes.json": b'{"a": 1}'})


# --------------------------------------------------------------------------------------------- HTTP

@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_http_archive(tmp_path, http_server, kind):
    files = _sample_files()
    build = _tar_gz if kind == "tar.gz" else _zip
    data = build(http_server.root / f"coco.{kind}", files)
    out = tmp_path / "raw"
    digest = download(f"{http_server.url}/coco.{kind}", out, sha256=_sha(data), **FAST)
    assert digest == _sha(data)
    _assert_tree(out, files)
    assert http_server.log == [(f"/coco.{kind}", None)]
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("behaviour", ["drop", "stall"])
def test_http_resumes_with_range_after_a_cut(tmp_path, http_server, behaviour, caplog, monkeypatch):
    files = _sample_files()
    data = _tar_gz(http_server.root / "coco.tar.gz", files)
    t0 = time.monotonic()
    timeout = 0.5 if behaviour == "stall" else 5
    monkeypatch.setattr(sys, "stderr", io.StringIO())      # no terminal: progress goes to the log
    with caplog.at_level(logging.INFO, logger="detpipe.core.progress"):
        download(f"{http_server.url}/{behaviour}/coco.tar.gz", tmp_path / "raw", sha256=_sha(data),
                 retries=3, timeout_s=timeout, backoff_s=0.05)
    progress = [r.getMessage() for r in caplog.records if r.name == "detpipe.core.progress"]
    # the resumed attempt counts on from the bytes kept and logs its end: all of the file's bytes
    assert progress and re.fullmatch(r"coco\.tar\.gz: ([\d.]+ (?:[KMG]i)?B)/\1, [\d.]+ (?:[KMG]i)?B/s", progress[-1]), \
        progress
    _assert_tree(tmp_path / "raw", files)
    path = f"/{behaviour}/coco.tar.gz"
    assert [p for p, _ in http_server.log] == [path, path]
    first, second = (r for _, r in http_server.log)
    assert first is None and second is not None and second.startswith("bytes=") and second.endswith("-")
    resumed_at = int(second[len("bytes="):-1])
    assert resumed_at == http_server.sent[path]        # every byte received before the cut was kept
    if behaviour == "stall":                    # the read timeout (0.5 s) ended the silent 3 s wait
        assert time.monotonic() - t0 < 2.5


def test_http_server_ignoring_range_restarts_cleanly(tmp_path, http_server):
    data = _tar_gz(http_server.root / "coco.tar.gz", _sample_files())
    dest = tmp_path / "coco.tar.gz"
    assert http_fetch(f"{http_server.url}/norange/coco.tar.gz", dest, **FAST) == len(data)
    assert dest.read_bytes() == data
    assert http_server.log[1][1] is not None          # it asked for a range, got 200, restarted


def test_http_503_is_retried_then_gives_up(tmp_path, http_server):
    (http_server.root / "f.bin").write_bytes(b"x" * 1000)
    assert http_fetch(f"{http_server.url}/flaky/f.bin", tmp_path / "f.bin", **FAST) == 1000
    assert http_server.counts["/flaky/f.bin"] == 2
    with pytest.raises(StageError, match=r"failed after 3 attempts: .*HTTP 503"):
        http_fetch(f"{http_server.url}/down/f.bin", tmp_path / "g.bin", retries=2, timeout_s=5, backoff_s=0.01)
    assert http_server.counts["/down/f.bin"] == 3


@pytest.mark.parametrize("route,status", [("/missing.tar.gz", 404), ("/forbidden/coco.tar.gz", 403)])
def test_http_404_403_fail_at_once_and_leave_nothing(tmp_path, http_server, caplog, route, status):
    caplog.set_level(logging.INFO)                      # the stage's level (run_program)
    host = urlsplit(http_server.url).netloc
    url = f"http://someone:Pa55word-Secret@{host}{route}?X-Amz-Signature=deadbeefcafe"
    with pytest.raises(StageError) as e:
        download(url, tmp_path / "raw", **FAST)
    msg = str(e.value)
    assert f"http://***@{host}{route}" in msg and f"HTTP {status}" in msg
    for secret in ("Pa55word-Secret", "deadbeefcafe", "someone"):
        assert secret not in msg and secret not in caplog.text
    assert http_server.counts[route] == 1               # no retry
    assert not (tmp_path / "raw").exists() and _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------- unsafe archives

def _evil_tar(path: Path, member: tarfile.TarInfo, data: bytes = b"evil") -> Path:
    with tarfile.open(path, "w") as tf:
        good = tarfile.TarInfo("ok.txt")
        good.size = 2
        tf.addfile(good, io.BytesIO(b"ok"))
        if member.isfile():
            member.size = len(data)
            tf.addfile(member, io.BytesIO(data))
        else:
            tf.addfile(member)
    return path


def _link(name: str, target: str, kind=tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink_etc_passwd", "symlink_up", "hardlink_out"])
def test_unsafe_tar_entries_are_refused(tmp_path, case):
    dest = tmp_path / "area" / "dest"
    dest.mkdir(parents=True)
    outside = tmp_path / "area" / "evil"
    member = {
        "dotdot": tarfile.TarInfo("../evil"),
        "absolute": tarfile.TarInfo(str(outside)),
        "symlink_etc_passwd": _link("passwd", "/etc/passwd"),
        "symlink_up": _link("sub/up", "../../evil"),
        "hardlink_out": _link("hl", "../evil", tarfile.LNKTYPE),
    }[case]
    archive = _evil_tar(tmp_path / "evil.tar", member)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(StageError) as e:
        extract(archive, dest, label="http://example/evil.tar")
    msg = str(e.value)
    assert msg.startswith("http://example/evil.tar: unsafe entry ") and repr(member.name) in msg
    assert "\n" not in msg
    assert not outside.exists()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before   # nothing written


def test_symlink_chain_escaping_is_caught_by_the_data_filter(tmp_path):
    # each link looks inside on its own ("a" -> ".", "a/b" -> "a/.." = "."), but a/b really is dest/..
    archive = tmp_path / "chain.tar"
    with tarfile.open(archive, "w") as tf:
        tf.addfile(_link("a", "."))
        tf.addfile(_link("a/b", ".."))
    out = tmp_path / "area" / "raw"
    with pytest.raises(StageError, match=r"chain.tar: unsafe entry 'a/b'"):
        download(str(archive), out)
    assert not out.exists() and sorted(p.name for p in (tmp_path / "area").iterdir()) == []


@pytest.mark.parametrize("name", ["../evil.txt", "/abs/evil.txt", "a/../../evil.txt"])
def test_unsafe_zip_entry_is_refused(tmp_path, name):
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("ok.txt", b"ok")
        zf.writestr(name, b"evil")
    out = tmp_path / "area" / "raw"
    with pytest.raises(StageError) as e:
        download(str(archive), out)
    assert f"evil.zip: unsafe entry {name!r}" in str(e.value)
    assert not out.exists() and not (tmp_path / "evil.txt").exists() and not (tmp_path / "area" / "evil.txt").exists()
    assert list((tmp_path / "area").iterdir()) == []


# --------------------------------------------------------------------------------------------- S3

def test_s3_folder_prefix_and_archive(tmp_path, s3_server, monkeypatch, caplog):
    caplog.set_level(logging.INFO)                      # the stage's level (run_program)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    fs = s3_server.filesystem()
    bucket = s3_server.create_bucket()
    files = _sample_files()
    for name, data in files.items():
        fs.pipe(f"{bucket}/coco/{name}", data)
    local = tmp_path / "expected"
    for name, data in files.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)

    out = tmp_path / "raw"
    digest = download(f"s3://{bucket}/coco/", out, sha256=_manifest_sha(local),
                      endpoint_url=s3_server.endpoint_url, **FAST)
    assert digest == _manifest_sha(local)
    _assert_tree(out, files)

    data = _tar_gz(tmp_path / "coco.tar.gz", files)
    fs.pipe(f"{bucket}/archives/coco.tar.gz", data)
    digest = download(f"s3://{bucket}/archives/coco.tar.gz", tmp_path / "raw2", sha256=_sha(data),
                      endpoint_url=s3_server.endpoint_url, **FAST)
    assert digest == _sha(data)
    _assert_tree(tmp_path / "raw2", files)
    assert s3_server.secret_key not in caplog.text
    assert _leftovers(tmp_path) == []


def test_s3_missing_key_and_bad_credentials(tmp_path, s3_server, monkeypatch):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    bucket = s3_server.create_bucket()
    s3_server.filesystem().pipe(f"{bucket}/x.zip", b"not really")
    with pytest.raises(StageError, match=rf"s3://{bucket}/nothing.zip: not found"):
        download(f"s3://{bucket}/nothing.zip", tmp_path / "raw", endpoint_url=s3_server.endpoint_url, **FAST)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    t0 = time.monotonic()
    with pytest.raises(StageError, match="access denied") as e:
        fetch(f"s3://{bucket}/x.zip", tmp_path / "x.zip", endpoint_url=s3_server.endpoint_url,
              retries=3, timeout_s=5, backoff_s=1.0)
    assert time.monotonic() - t0 < 1.0               # no backoff: a 403 is not retried
    assert "wrong-secret" not in str(e.value)
    assert not (tmp_path / "raw").exists()


# --------------------------------------------------------------------------------------------- CLI

def _workdir(tmp_path: Path, **download_params) -> Path:
    """A run folder with the repo's params.yaml (download section updated) and data/coco128 linked in."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "coco128").symlink_to(COCO, target_is_directory=True)
    write_params(work, {"download": download_params}, tiny=False)
    return work


def _run(work: Path, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "stages.download", *args], work, check=False, timeout=60)


def _assert_one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert "Traceback" not in stderr
    return errors[0]


def _run_failing(work: Path) -> str:
    """Run the stage in ``work`` over a previous data/raw (one file): it must fail with exit status 2 and one
    error line (returned), leave that data/raw as it was, and leave no temporary beside it."""
    raw = work / "data" / "raw"
    raw.mkdir()
    (raw / "old.txt").write_text("previous")
    res = _run(work)
    assert res.returncode == 2, res.stderr
    line = _assert_one_error_line(res.stderr)
    assert [p.name for p in raw.iterdir()] == ["old.txt"] and _leftovers(work / "data") == []
    return line


def test_stage_default_params_copy_embedded_dataset(tmp_path):
    work = _workdir(tmp_path)                              # the repo's params.yaml as it is
    res = _run(work)
    assert res.returncode == 0, res.stderr
    raw = work / "data" / "raw"
    assert (raw / "annotations" / "instances_train2017.json").is_file()
    assert len(list((raw / "train2017").glob("*.jpg"))) == 128
    assert _manifest_sha(raw) == _manifest_sha(COCO)
    assert f"sha256 of folder manifest data/coco128: {_manifest_sha(COCO)}" in res.stderr
    assert _leftovers(work / "data") == []
    # stderr is no terminal (as under Prefect): the copy's progress is a log line, the last one at the end
    assert re.search(r"detpipe\.core\.progress INFO coco128: ([\d.]+ MiB)/\1, [\d.]+ [KMG]?i?B/s$", res.stderr, re.M), \
        res.stderr


def test_stage_failure_is_one_error_line_and_keeps_old_output(tmp_path):
    line = _run_failing(_workdir(tmp_path, sha256="1" * 64))
    assert "data/coco128" in line and "1" * 64 in line and _manifest_sha(COCO) in line


def test_stage_http_404_subprocess(tmp_path, http_server):
    work = _workdir(tmp_path, source=f"{http_server.url}/nope.zip")
    res = _run(work)
    assert res.returncode == 2
    line = _assert_one_error_line(res.stderr)
    assert f"{http_server.url}/nope.zip" in line and "404" in line
    assert not (work / "data" / "raw").exists() and _leftovers(work / "data") == []


def test_print_sha256_cli(tmp_path, http_server):
    work = _workdir(tmp_path)
    res = _run(work, "--print-sha256", "data/coco128")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == _manifest_sha(COCO)
    data = _zip(http_server.root / "s.zip", _sample_files())
    res = _run(work, "--print-sha256", f"{http_server.url}/s.zip")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == _sha(data)


# --------------------------------------------------------------------------------------------- limits

def _zip_bomb(path: Path, nbytes: int) -> Path:
    """A zip of one member holding ``nbytes`` zeros (deflate packs it ~1000:1), written in 1 MiB pieces."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf, zf.open("bomb/zeros.bin", "w") as f:
        for _ in range(nbytes >> 20):
            f.write(bytes(1 << 20))
    return path


@pytest.mark.parametrize("ratio_limit", [200, 5000])
def test_stage_refuses_a_zip_bomb_and_leaves_data_raw_as_it_was(tmp_path, ratio_limit):
    """64 MiB of zeros in a ~64 kB zip (ratio ~1000) is refused under the default ratio limit with one error
    line and nothing written; with the limit raised past its ratio the same archive extracts (so the limit,
    not something else, is what refuses it)."""
    bomb = _zip_bomb(tmp_path / "bomb.zip", 64 << 20)
    ratio = (64 << 20) / bomb.stat().st_size
    assert 200 < ratio < 5000
    work = _workdir(tmp_path, source=str(bomb), sha256=None, max_compression_ratio=ratio_limit)
    raw = work / "data" / "raw"
    raw.mkdir()
    (raw / "old.txt").write_text("previous")
    res = _run(work)
    if ratio_limit > ratio:
        assert res.returncode == 0, res.stderr
        assert (raw / "bomb" / "zeros.bin").stat().st_size == 64 << 20     # the top-level folder is kept
        return
    assert res.returncode == 2
    line = _assert_one_error_line(res.stderr)
    assert str(bomb) in line and "download.max_compression_ratio = 200" in line and "nothing was extracted" in line
    assert [p.name for p in raw.iterdir()] == ["old.txt"] and _leftovers(work / "data") == []


def test_stage_max_extract_bytes(tmp_path):
    files = {f"mydata/{name}": data for name, data in _sample_files().items()}
    archive = tmp_path / "d.zip"
    _zip(archive, files)
    total = sum(len(d) for d in files.values())
    work = _workdir(tmp_path, source=str(archive), sha256=None, max_extract_bytes=total - 1)
    res = _run(work)
    assert res.returncode == 2
    line = _assert_one_error_line(res.stderr)
    assert f"would extract to {total} bytes, more than download.max_extract_bytes = {total - 1}" in line
    assert not (work / "data" / "raw").exists() and _leftovers(work / "data") == []
    ok = tmp_path / "ok"
    ok.mkdir()
    assert extract(archive, ok, max_bytes=total) == len(files)
    _assert_tree(ok, files)                                # at the limit: extracted, top-level folder kept


# --------------------------------------------------------------------------------------------- several parts

def _coco2017_parts(www: Path) -> tuple[list[tuple[str, str]], dict[str, bytes]]:
    """COCO 2017's three official archives in miniature, from real COCO128 files under their real names:
    ``train2017.zip`` (train2017/ images), ``val2017.tar.gz`` (val2017/ images, a tar to mix the kinds) and
    ``annotations_trainval2017.zip`` (annotations/). Returns ([(file name, sha256)], every extracted file)."""
    imgs = sorted((COCO / "train2017").glob("*.jpg"))
    ann = (COCO / "annotations" / "instances_train2017.json").read_bytes()
    trees = {"train2017.zip": {f"train2017/{p.name}": p.read_bytes() for p in imgs[:4]},
             "val2017.tar.gz": {f"val2017/{p.name}": p.read_bytes() for p in imgs[4:6]},
             "annotations_trainval2017.zip": {"annotations/instances_train2017.json": ann,
                                              "annotations/instances_val2017.json": ann[: len(ann) // 3]}}
    parts = []
    for name, files in trees.items():
        data = (_zip if name.endswith(".zip") else _tar_gz)(www / name, files)
        parts.append((name, _sha(data)))
    return parts, {k: v for files in trees.values() for k, v in files.items()}


def test_parts_over_http_one_cut_off_resumed_and_merged(tmp_path, http_server):
    """``download.source`` as a list of three archives with their sha256s (a plain string item too): the first is
    cut off mid-transfer on its first request and resumed with a Range request from the byte where the cut fell;
    all three are checked, extracted and merged into the one data/raw; nothing is left beside it."""
    parts, files = _coco2017_parts(http_server.root)
    (train, train_sha), (val, val_sha), (ann, ann_sha) = parts
    url = http_server.url
    cfg = Download(source=[{"url": f"{url}/drop/{train}", "sha256": train_sha},
                           {"url": f"{url}/{val}", "sha256": val_sha}, f"{url}/{ann}"], timeout_s=5)
    out = tmp_path / "raw"
    assert download_raw(cfg, out) == [train_sha, val_sha, ann_sha]
    _assert_tree(out, files)
    cut = f"/drop/{train}"
    assert http_server.log == [(cut, None), (cut, f"bytes={http_server.sent[cut]}-"), (f"/{val}", None),
                               (f"/{ann}", None)]
    assert 0 < http_server.sent[cut] < (http_server.root / train).stat().st_size
    assert _leftovers(tmp_path) == []


def test_stage_wrong_sha256_of_one_part_names_it_and_keeps_data_raw(tmp_path, http_server):
    """The stage with COCO 2017's params in miniature, the second part's sha256 wrong: one error line naming that
    part (its index in params and its URL) with both hashes; the third part is never fetched; data/raw as it was.
    With the right hash the same params download all three."""
    parts, files = _coco2017_parts(http_server.root)
    wrong = "e" * 64
    source = [{"url": f"{http_server.url}/{name}", "sha256": wrong if i == 1 else sha}
              for i, (name, sha) in enumerate(parts)]
    line = _run_failing(_workdir(tmp_path, source=source, sha256=None))
    assert f"download.source[1] {http_server.url}/val2017.tar.gz: sha256 mismatch" in line, line
    assert wrong in line and parts[1][1] in line
    assert [p for p, _ in http_server.log] == ["/train2017.zip", "/val2017.tar.gz"]
    source[1]["sha256"] = parts[1][1]
    work = _workdir(tmp_path / "again", source=source, sha256=None)
    res = _run(work)
    assert res.returncode == 0, res.stderr
    _assert_tree(work / "data" / "raw", files)


@pytest.mark.parametrize("clash", ["same bytes", "different bytes", "file and folder"])
def test_parts_holding_the_same_path(tmp_path, clash):
    """Two parts (a tar.gz and a zip, read in place) with one path in common: the same bytes are kept once; a
    file with different bytes, or a file where the other part has a folder, fails naming the path and both
    parts, and the output stays as it was."""
    first = {"annotations/instances_train2017.json": b'{"images": []}', "train2017/a.jpg": IMAGES[0].read_bytes()}
    second = {"val2017/b.jpg": IMAGES[1].read_bytes(),
              "same bytes": {"annotations/instances_train2017.json": b'{"images": []}'},
              "different bytes": {"annotations/instances_train2017.json": b'{"images": [1]}'},
              "file and folder": {"train2017/a.jpg/x.jpg": b"x"}}[clash]
    second = {"val2017/b.jpg": IMAGES[1].read_bytes(), **second}
    a, b = tmp_path / "a.tar.gz", tmp_path / "b.zip"
    _tar_gz(a, first), _zip(b, second)
    out = tmp_path / "raw"
    if clash == "same bytes":
        download_parts([(str(a), None), (str(b), None)], out)
        _assert_tree(out, {**first, **second})
        return
    out.mkdir()
    (out / "old.txt").write_text("previous")
    with pytest.raises(StageError) as e:
        download_parts([(str(a), None), (str(b), None)], out)
    msg = str(e.value)
    path = "annotations/instances_train2017.json" if clash == "different bytes" else "train2017/a.jpg"
    assert f"download.source[1] {b}" in msg and f"download.source[0] {a}" in msg and f"'{path}'" in msg, msg
    assert ("different bytes" if clash == "different bytes" else "a file in one and a folder") in msg
    assert [p.name for p in out.iterdir()] == ["old.txt"] and _leftovers(tmp_path) == []


def test_download_params_accept_a_list_of_parts(tmp_path):
    """params.yaml: the single-string form as before; a list of {url, sha256} and plain strings; refused with one
    line naming the key: a top-level sha256 beside a list, a part's malformed sha256 (by index), an empty list."""
    def check(download: dict):
        path = tmp_path / "params.yaml"
        params = yaml.safe_load((REPO / "params.yaml").read_text())
        params["download"] = download
        path.write_text(yaml.safe_dump(params))
        return load("download", path)

    assert check({"source": "data/coco128"}).parts == [DownloadPart(url="data/coco128")]
    cfg = check({"source": ["a.zip", {"url": "s3://b/c.tar", "sha256": "a" * 64}]})
    assert cfg.parts == [DownloadPart(url="a.zip"), DownloadPart(url="s3://b/c.tar", sha256="a" * 64)]
    for bad, words in [({"source": ["a.zip"], "sha256": "a" * 64}, "sha256 must be null when source is a list"),
                       ({"source": ["a.zip", {"url": "b.zip", "sha256": "XYZ"}]}, "part 1: sha256"),
                       ({"source": ["a.zip", {"url": "b.zip", "md5": "0"}]}, "part 1: md5"),
                       ({"source": []}, "empty list")]:
        with pytest.raises(StageError) as e:
            check(bad)
        assert "key 'download" in str(e.value) and words in str(e.value), str(e.value)
