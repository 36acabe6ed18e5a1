"""`python -m detpipe.serve` (issue 36.6): the real server, started as a subprocess on a free loopback port (one for
the module), asked by a real HTTP client (httpx), on the model that fits real images (the session fixture
`fitted_workdir`'s ``models/model.pt``: real detections, sharp scores).

What is proven: ``POST /predict`` answers an image (raw body or multipart) with exactly what ``python -m
detpipe.predict`` writes for it (boxes in original-image pixels, the dataset's category ids); ``/healthz`` answers
while ``/readyz`` is 503 until the model is loaded and warmed up; each bad request (too large, chunked and too large,
not an image, empty, truncated, decompression bombs, malformed multipart, bad query, wrong method, wrong route) gets
its 4xx with a one-line JSON reason and the server goes on serving; a full queue is 503 with Retry-After at once and
the requests it admits are batched and answered right; a missing model and a port in use are one-line errors; SIGTERM
stops the server cleanly (exit status 0) and it started no process.

The server is started once (about 5 s on this machine plus the torch import); the SIGTERM test stops it, so it
comes last in the file.
"""
from __future__ import annotations

import asyncio
import io
import json
import shutil
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import httpx
import psutil
import pytest
from PIL import Image

from support.pipeline import COCO128
from support.procs import run
from support.serve import results_differ, running_server

MAX_BYTES = 1_000_000        # the test server's --max-bytes (COCO128's largest image is ~400 KB)
MAX_PIXELS = 20_000_000      # its --max-pixels
OPTIONS = ("--queue-size", "2", "--max-batch", "4", "--max-wait-ms", "20", "--max-bytes", str(MAX_BYTES),
           "--max-pixels", str(MAX_PIXELS), "--workers", "2")
OTHER_IMAGES = ("000000000009.jpg", "000000000036.jpg")   # not in the fitted set: 640x480, 481x640
THRESHOLD = 0.25             # the server's (and predict's) default score threshold
COCO_IDS = {18, 22, 24, 25}  # the fitted dataset's categories (dog, elephant, zebra, giraffe)


@pytest.fixture(scope="module")
def images(fitted_workdir, tmp_path_factory) -> Path:
    """A folder with the 4 fitted images (from the fitted run's data/raw) and `OTHER_IMAGES` from COCO128."""
    folder = tmp_path_factory.mktemp("serve") / "images"
    folder.mkdir()
    for f in (fitted_workdir / "data/raw/images").iterdir():
        shutil.copyfile(f, folder / f.name)
    for name in OTHER_IMAGES:
        shutil.copyfile(COCO128 / "train2017" / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def offline(fitted_workdir, images) -> dict[str, list[dict]]:
    """``python -m detpipe.predict`` on `images` with the same model (one image per batch, every score): each
    file's predictions, as predict wrote them (image ids 1.. in file name order)."""
    out = images.parent / "predicted"
    run([sys.executable, "-m", "detpipe.predict", str(images), "--model", "models/model.pt", "--out", str(out),
         "--batch-size", "1", "--score-threshold", "0", "--no-draw"], fitted_workdir)
    preds = json.loads((out / "predictions.json").read_text())
    found = {f.name: [p for p in preds if p["file_name"] == f.name] for f in sorted(images.iterdir())}
    assert all(found.values()), {k: len(v) for k, v in found.items()}
    return found


@pytest.fixture(scope="module")
def server(fitted_workdir, images):
    """The module's server: `OPTIONS`, fitted_workdir's model.pt and data/, ready (``/readyz`` 200)."""
    with running_server(fitted_workdir / "models/model.pt", fitted_workdir / "data", images.parent / "serve.log",
                        *OPTIONS) as srv:
        yield srv


def _above(preds: list[dict], threshold: float = THRESHOLD) -> list[dict]:
    return [p for p in preds if p["score"] >= threshold]


def _ids(offline: dict) -> dict[str, int]:
    """predict's image id of each file (its detections carry it)."""
    return {name: preds[0]["image_id"] for name, preds in offline.items()}


def test_health_and_readiness(server, fitted_workdir):
    """While the model loads, ``/readyz`` is 503 (the fixture saw it, polling from the start), then 200 with the
    model and runtime; ``/healthz`` is 200."""
    seen = [s for s in server.readyz_seen if s is not None]
    assert seen[0] == 503 and seen[-1] == 200 and seen.count(200) == 1, server.readyz_seen
    with httpx.Client(base_url=server.url) as client:
        health = client.get("/healthz")
        ready = client.get("/readyz")
    assert health.status_code == 200 and health.json() == {"alive": True}
    body = ready.json()
    assert ready.status_code == 200 and body["ready"] is True
    assert body["model"] == str(fitted_workdir / "models/model.pt") and body["runtime"].startswith("torch")
    assert (body["queue_size"], body["max_batch"]) == (2, 4)


def test_raw_body_answers_as_predict(server, images, offline):
    """Each image POSTed as the raw body (with predict's image id and file name) is answered with exactly
    predict's predictions for it: every detection (``score_threshold=0``) and, by default, those scoring >= 0.25;
    boxes in original-image pixels, the dataset's COCO category ids. Sequential requests run one image per batch,
    as the reference did: the floats are equal, not only close."""
    ids = _ids(offline)
    confident = 0
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for name, preds in offline.items():
            data = (images / name).read_bytes()
            all_of = client.post("/predict", content=data, headers={"Content-Type": "image/jpeg"},
                                 params={"image_id": ids[name], "file_name": name, "score_threshold": 0})
            assert all_of.status_code == 200, all_of.text
            assert all_of.headers["X-Batch-Size"] == "1"
            assert all_of.json() == preds, name
            default = client.post("/predict", content=data, params={"image_id": ids[name], "file_name": name})
            assert default.status_code == 200 and default.json() == _above(preds), name
            width, height = Image.open(images / name).size
            for p in default.json():
                x, y, w, h = p["bbox"]
                assert p["category_id"] in COCO_IDS and 0 <= x <= x + w <= width and 0 <= y <= y + h <= height
            confident += len(default.json())
    assert confident >= 4, "the fitted model should find its objects: the comparison would be empty"


def test_multipart_answers_as_predict(server, images, offline):
    """The image as a multipart file field (``curl -F image=@photo.jpg``): the part's file name is the answer's
    ``file_name`` and the image id 1 (predict's numbering of a one-image source); otherwise predict's predictions."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for name, preds in offline.items():
            r = client.post("/predict", files={"image": (name, (images / name).read_bytes(), "image/jpeg")},
                            params={"score_threshold": 0})
            assert r.status_code == 200, r.text
            assert r.json() == [dict(p, image_id=1) for p in preds], name


def _png(width: int, height: int, rows: int | None = None, color_type: int = 2) -> bytes:
    """An 8-bit PNG declaring ``width`` x ``height`` whose pixel data is ``rows`` rows of zeros (all rows:
    a complete image that really decodes to that size; fewer: a header that lies)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    channels = {0: 1, 2: 3}[color_type]
    raw = (b"\0" * (1 + channels * width)) * (height if rows is None else rows)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _too_large_chunks():
    for _ in range(MAX_BYTES // 65536 + 2):
        yield b"\0" * 65536


MULTIPART_NO_FILE = (b'--xyz\r\nContent-Disposition: form-data; name="note"\r\n\r\nhello\r\n--xyz--\r\n',
                     "multipart/form-data; boundary=xyz")
# case: (method, path, body, content type, query, expected status, words of the reason)
BAD = {
    "too_large": ("POST", "/predict", b"\0" * (MAX_BYTES + 1), "image/jpeg", {}, 413, "larger than --max-bytes"),
    "too_large_chunked": ("POST", "/predict", "chunks", "image/jpeg", {}, 413, "larger than --max-bytes"),
    "not_an_image": ("POST", "/predict", b"just some text\n", "text/plain", {}, 415, "not an image"),
    "empty": ("POST", "/predict", b"", "image/jpeg", {}, 400, "empty body"),
    "truncated_jpeg": ("POST", "/predict", "truncated", "image/jpeg", {}, 400, "unreadable or corrupt image"),
    "bomb_header": ("POST", "/predict", _png(30000, 30000, rows=2), "image/png", {}, 422,
                    "declares 900000000 pixels, more than --max-pixels"),
    "bomb_zeros": ("POST", "/predict", _png(6000, 6000, color_type=0), "image/png", {}, 422,
                   "declares 36000000 pixels, more than --max-pixels"),
    "multipart_without_file": ("POST", "/predict", *MULTIPART_NO_FILE, {}, 400, "without a file part"),
    "multipart_malformed": ("POST", "/predict", b"hello", "multipart/form-data", {}, 400, "boundary"),
    "bad_query": ("POST", "/predict", "good", "image/jpeg", {"score_threshold": "2"}, 400,
                  "score_threshold='2': must be a number in [0, 1]"),
    "wrong_method": ("GET", "/predict", None, None, {}, 405, "method not allowed (allowed: POST)"),
    "wrong_route": ("POST", "/detect", "good", "image/jpeg", {}, 404, "no such route"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_a_4xx_with_a_reason_and_the_server_goes_on(server, images, offline, case):
    """Each bad request is answered with its status and ``{"error": "<one line>"}`` naming the rule (no traceback;
    the bombs are refused before decoding: their header declares more than --max-pixels); the next good request is
    answered as predict answers it."""
    method, path, body, ctype, query, status, words = BAD[case]
    name = OTHER_IMAGES[0]
    good = (images / name).read_bytes()
    if isinstance(body, str):
        body = {"chunks": _too_large_chunks(), "truncated": good[:len(good) // 2], "good": good}[body]
    if case == "bomb_zeros":
        assert len(body) < 100_000 and Image.open(io.BytesIO(body)).size == (6000, 6000)
    headers = {"Content-Type": ctype} if ctype else {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        r = client.request(method, path, content=body, headers=headers, params=query)
        assert r.status_code == status, (r.status_code, r.text)
        assert r.headers["content-type"] == "application/json"
        reason = r.json()["error"]
        assert words in reason and "\n" not in reason and "Traceback" not in reason, reason
        if case == "wrong_method":
            assert r.headers["allow"] == "POST"
        after = client.post("/predict", content=good, params={"image_id": _ids(offline)[name], "file_name": name})
    assert after.status_code == 200 and after.json() == _above(offline[name])


def test_full_queue_is_503_at_once_and_admitted_requests_are_batched(server, images, offline):
    """Floods of 12 concurrent requests at a queue of 2: some are refused at once with 503, ``Retry-After`` and
    the reason, the others are answered (in batches of more than one image: ``X-Batch-Size``) with predict's
    predictions within 1e-3 px and 1e-5 in score (a batch rounds a few floats differently from a batch of one).
    Afterwards nothing is left counted in the queue and the server answers as before."""
    ids = _ids(offline)
    names = list(offline) * 2

    async def flood() -> list[tuple[str, httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async def one(name):
                return name, await client.post("/predict", content=(images / name).read_bytes(),
                                               params={"image_id": ids[name], "file_name": name})
            return await asyncio.gather(*(one(n) for n in names))

    refused = answered = 0
    batches: set[int] = set()
    for _ in range(5):    # each flood almost surely overflows a queue of 2 and batches; more rounds if not
        for name, r in asyncio.run(flood()):
            if r.status_code == 503:
                assert r.headers["Retry-After"] == "1" and "queue full" in r.json()["error"], r.text
                refused += 1
                continue
            assert r.status_code == 200, r.text
            assert results_differ(r.json(), _above(offline[name])) is None, (name, results_differ(
                r.json(), _above(offline[name])))
            batches.add(int(r.headers["X-Batch-Size"]))
            answered += 1
        if refused and max(batches, default=0) > 1:
            break
    print(f"refused {refused}, answered {answered}, batch sizes {sorted(batches)}")
    assert refused and answered and max(batches) > 1
    with httpx.Client(base_url=server.url, timeout=120) as client:
        status = client.get("/readyz").json()
        assert status["waiting"] == 0 and status["largest_batch"] > 1, status
        name = OTHER_IMAGES[1]
        r = client.post("/predict", content=(images / name).read_bytes(), params={"image_id": ids[name],
                                                                                 "file_name": name})
        assert r.status_code == 200 and r.json() == _above(offline[name])


def _scrape(url: str) -> dict[tuple, float]:
    """``GET /metrics`` parsed by prometheus_client's own parser (an independent reference, not our writer):
    ``{(sample name, ((label, value), ...) sorted): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def _delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_a_known_load(server, images, offline):
    """``GET /metrics`` is Prometheus text (parsed with prometheus_client's parser) and counts a known load exactly:
    3 images answered 200, one non-image 415, one unknown route 404 (as route ``other``) -> the requests counter by
    status, the latency histogram's count (and its ``+Inf`` bucket), the batch-size histogram (3 sequential images:
    3 batches of 1), the queue depth back to 0, and one ``model_info`` sample naming ``/readyz``'s version."""
    name = OTHER_IMAGES[0]
    before = _scrape(server.url)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for _ in range(3):
            assert client.post("/predict", content=(images / name).read_bytes()).status_code == 200
        assert client.post("/predict", content=b"not an image").status_code == 415
        assert client.get("/nowhere").status_code == 404
        version = client.get("/readyz").json()["version"]
    after = _scrape(server.url)
    print(httpx.get(f"{server.url}/metrics").text)     # the scraped page, for the record (pytest -s)
    assert _delta(after, before, "detpipe_serve_requests_total", route="/predict", status="200") == 3
    assert _delta(after, before, "detpipe_serve_requests_total", route="/predict", status="415") == 1
    assert _delta(after, before, "detpipe_serve_requests_total", route="other", status="404") == 1
    assert _delta(after, before, "detpipe_serve_request_duration_seconds_count", route="/predict") == 4
    assert _delta(after, before, "detpipe_serve_request_duration_seconds_bucket", route="/predict", le="+Inf") == 4
    assert _delta(after, before, "detpipe_serve_request_duration_seconds_sum", route="/predict") > 0
    assert _delta(after, before, "detpipe_serve_batch_size_count") == 3
    assert _delta(after, before, "detpipe_serve_batch_size_sum") == 3
    assert _delta(after, before, "detpipe_serve_batch_size_bucket", le="1.0") == 3
    assert after[("detpipe_serve_queue_depth", ())] == 0
    assert after[("detpipe_serve_connections", (("state", "waiting"),))] == 0
    models = [labels for (n, labels), v in after.items() if n == "detpipe_serve_model_info" and v == 1]
    assert len(models) == 1 and dict(models[0])["version"] == version, models


def _slow_client_run(url: str, body: bytes, stalled_n: int, normal_n: int, wait_s: float
                     ) -> tuple[list, list, list[float]]:
    """``stalled_n`` connections that send a POST /predict's headers and half its body, then stall; then
    ``normal_n`` concurrent normal requests (each on its own connection) with a ``wait_s`` client timeout; then
    how each stalled socket ended. Returns ``(normal statuses or exception names, normal seconds, seconds until
    each stalled socket was closed by the server (None: still open 2 body timeouts + 4 s after the start, or after
    the normal requests if later))``."""
    import socket
    import time

    head = (f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: {len(body)}\r\n"
            "\r\n").encode()
    t0 = time.monotonic()
    stalled = []
    for _ in range(stalled_n):
        sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)
        sock.sendall(head + body[:len(body) // 2])
        stalled.append(sock)
    time.sleep(0.2)

    async def normal() -> tuple[list, list]:
        limits = httpx.Limits(max_connections=normal_n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=wait_s, limits=limits) as client:
            async def one():
                start = time.monotonic()
                try:
                    r = await client.post("/predict", content=body)
                    return r.status_code, time.monotonic() - start
                except httpx.TransportError as e:
                    return type(e).__name__, time.monotonic() - start
            got = await asyncio.gather(*(one() for _ in range(normal_n)))
        return [g[0] for g in got], [g[1] for g in got]
    statuses, seconds = asyncio.run(normal())
    closed: list = []
    deadline = t0 + 2 * BODY_TIMEOUT_S + 4   # the 32 served stalled clients' body timeout, then the 8 waiting ones'
    for sock in stalled:       # the server closes each (after its 408, with the body timeout on)
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            while sock.recv(65536):
                pass
            closed.append(time.monotonic() - t0)
        except (TimeoutError, socket.timeout):
            closed.append(None)
        except ConnectionResetError:
            closed.append(time.monotonic() - t0)
        finally:
            sock.close()
    return statuses, seconds, closed


BODY_TIMEOUT_S = 2
NORMAL_WAIT_S = BODY_TIMEOUT_S + 8   # a normal request's allowance: the body timeout + its own latency (generous)


@pytest.mark.parametrize("timeouts", [True, False], ids=["timeouts_on", "timeouts_off_must_starve"])
def test_slow_clients_cannot_starve_normal_requests(fitted_workdir, images, offline, timeouts):
    """40 connections send a request's headers and half its body, then stall (more than ``--max-connections``
    32); then 10 normal requests. With ``--body-timeout 2 --header-timeout 2`` (timeouts_on) all 10 are answered
    200 with predict's results within the body timeout plus their own latency (`NORMAL_WAIT_S`: the stalled
    clients hold the 32 slots until the body timeout closes them, the normal ones wait for a slot instead of
    being refused), every stalled socket is closed by the server (a 408, then end of file), the log has one line
    per stalled client, ``detpipe_serve_slow_clients_total{phase="body"}`` counts 40; a client stalling in its
    headers and one sending nothing are closed by the header timeout, a kept-alive connection idle after its answer
    by ``--keep-alive-timeout 1``. The must-fail variant (timeouts_off: both 0, no limit) shows what
    the timeouts prevent: not one normal request is answered within the same allowance, the stalled sockets stay
    open."""
    name = OTHER_IMAGES[0]
    body = (images / name).read_bytes()
    off = () if timeouts else ("--body-timeout", "0", "--header-timeout", "0")
    on = ("--body-timeout", str(BODY_TIMEOUT_S), "--header-timeout", str(BODY_TIMEOUT_S),
          "--keep-alive-timeout", "1") if timeouts else ()
    log = images.parent / f"serve-slow-{timeouts}.log"
    with running_server(fitted_workdir / "models/model.pt", fitted_workdir / "data", log, *on, *off) as srv:
        statuses, seconds, closed = _slow_client_run(srv.url, body, 40, 10, NORMAL_WAIT_S)
        print(f"timeouts {'on' if timeouts else 'off'}: normal requests {statuses} in {[round(s, 1) for s in seconds]}"
              f" s; stalled sockets closed at {[None if c is None else round(c, 1) for c in closed]} s")
        if not timeouts:
            assert all(not isinstance(s, int) for s in statuses), statuses   # starved: no answer in NORMAL_WAIT_S
            assert all(c is None for c in closed), closed
            return
        assert statuses == [200] * 10, statuses
        assert max(seconds) <= NORMAL_WAIT_S, seconds
        assert all(c is not None for c in closed), closed
        r = httpx.post(f"{srv.url}/predict", content=body, timeout=60, params={"file_name": name,
                                                                               "image_id": _ids(offline)[name]})
        assert r.status_code == 200 and r.json() == _above(offline[name])
        # a client stalling in its headers, one sending nothing: closed by the header timeout; a kept-alive
        # connection idle after its answer: closed by the keep-alive timeout (1 s)
        import socket
        import time
        port = int(srv.url.rsplit(":", 1)[1])
        partial, idle, kept = (socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3))
        t0 = time.monotonic()
        partial.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\n")
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b'{"alive":true}' not in answer:
            answer += kept.recv(1024)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert kept.recv(1024) == b"" and time.monotonic() - t0 < 1 + 10
        for sock in (partial, idle):
            assert sock.recv(1024) == b""
        assert BODY_TIMEOUT_S - 0.5 < time.monotonic() - t0 < BODY_TIMEOUT_S + 10
        for sock in (partial, idle, kept):
            sock.close()
        metrics = _scrape(srv.url)
        assert metrics[("detpipe_serve_slow_clients_total", (("phase", "body"),))] == 40
        assert metrics[("detpipe_serve_slow_clients_total", (("phase", "headers"),))] == 2
        text = srv.log_text()
        assert text.count("request body not complete within --body-timeout 2 s") == 40, text[-3000:]
        assert text.count("request headers not complete within --header-timeout 2 s") == 2, text[-3000:]
        assert "Traceback" not in text, text[-3000:]


def test_startup_errors_are_one_line(server, fitted_workdir, tmp_path):
    """A missing model file, and a port already in use (the module's server's), are one line ``error: ...`` with
    exit status 2, no traceback (found before torch is imported). The command's defaults are predict's."""
    import detpipe.predict
    import detpipe.serve

    for name in ("DEFAULT_MODEL", "DEFAULT_DATA", "SCORE_THRESHOLD"):
        assert getattr(detpipe.serve, name) == getattr(detpipe.predict, name), name
    port = server.url.rsplit(":", 1)[1]
    for args, expect in ((["--model", "models/nothing.pt"], "error: models/nothing.pt: model not found"),
                         (["--model", "models/model.pt", "--port", port], f"error: 127.0.0.1:{port}: cannot listen")):
        proc = run([sys.executable, "-m", "detpipe.serve", *args], fitted_workdir, check=False, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(expect), proc.stderr[-3000:]


def test_reload_under_load_answers_every_request(server, fitted_workdir, images, offline, tmp_path):
    """A new model without downtime: while 2 clients send images back to back (the module server's queue of 2:
    never full), ``POST /admin/reload {"model": <a new model file>}`` loads and warms the new file, then swaps;
    then SIGHUP reloads it again. Every answer is counted: all are 200 with predict's results, each names the
    version it ran on (``X-Model-Version``), the old version before the swap, the new one after; ``/readyz`` and
    ``model_info`` name the new version. A model file that cannot be loaded and a bad body are refused with one line
    and the old model goes on serving. (The new file is the fitted model.pt saved again with another ``iters``: the
    same weights, another sha256, so the answers stay comparable.)"""
    import threading
    import time

    import torch

    ckpt = torch.load(fitted_workdir / "models/model.pt", map_location="cpu", weights_only=True)
    ckpt["iters"] = int(ckpt["iters"]) + 1
    new_model = tmp_path / "model-next.pt"
    torch.save(ckpt, new_model)
    name = OTHER_IMAGES[1]
    body, expected = (images / name).read_bytes(), _above(offline[name])
    params = {"image_id": _ids(offline)[name], "file_name": name}
    with httpx.Client(base_url=server.url, timeout=120) as admin:
        old = admin.get("/readyz").json()["version"]
        bad = admin.post("/admin/reload", json={"model": str(tmp_path / "nothing.onnx")})
        assert bad.status_code == 422 and f"still serving version {old}" in bad.json()["error"], bad.text
        assert admin.post("/admin/reload", content=b"{not json").status_code == 400
        assert admin.get("/readyz").json()["version"] == old

        answers: list[tuple[float, float, int, str, bool]] = []   # (start, end, status, version, results as predict)
        stop = threading.Event()

        def client():
            with httpx.Client(base_url=server.url, timeout=120) as c:
                for _ in range(400):                     # bounded in count, and by `stop` (set within ~30 s)
                    if stop.is_set():
                        return
                    t0 = time.monotonic()
                    r = c.post("/predict", content=body, params=params)
                    ok = r.status_code == 200 and results_differ(r.json(), expected) is None
                    answers.append((t0, time.monotonic(), r.status_code, r.headers.get("x-model-version", ""), ok))

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            reload = admin.post("/admin/reload", json={"model": str(new_model)})
            swapped = time.monotonic()
            assert reload.status_code == 200, reload.text
            new = reload.json()["version"]
            assert reload.json()["previous_version"] == old and new != old
            server.proc.send_signal(signal.SIGHUP)       # reload the served file again
            deadline = time.monotonic() + 30
            while server.log_text().count("serve: reloaded in") < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        status = admin.get("/readyz").json()
    statuses = [a[2] for a in answers]
    print(f"reload under load: {len(answers)} answers, statuses {sorted(set(statuses))}, "
          f"{sum(a[3] == old for a in answers)} on {old}, {sum(a[3] == new for a in answers)} on {new}")
    assert statuses == [200] * len(answers) and all(a[4] for a in answers), answers
    assert {a[3] for a in answers} == {old, new}
    assert all(a[3] == new for a in answers if a[0] > swapped), "a request started after the swap ran on the old model"
    assert server.log_text().count("serve: reloaded in") == 2, server.log_text()[-3000:]
    assert status["version"] == new and status["model"] == str(new_model), status
    models = [dict(labels) for (n, labels), v in _scrape(server.url).items() if n == "detpipe_serve_model_info"]
    assert [m["version"] for m in models] == [new], models


def test_sigterm_stops_the_server_cleanly(server):
    """The server started no process; SIGTERM stops it: exit status 0, its log says so, no traceback anywhere in
    the log of the whole module's requests, and the port no longer answers. (Stops the module's server: last.)"""
    assert psutil.Process(server.proc.pid).children(recursive=True) == []
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve still running 60 s after SIGTERM:\n{server.log_text()[-3000:]}")
    log = server.log_text()
    assert code == 0, log[-3000:]
    assert "serve: stopped by SIGTERM" in log and "Traceback" not in log, log[-3000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/healthz", timeout=5)
