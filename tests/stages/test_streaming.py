"""Training input streamed from a real SeaweedFS S3 server: whole shards prefetched into a bounded local folder,
the same batches as the local cache, one-line errors for a missing or corrupt remote shard, and kill -9 + resume
of the train stage reading through the prefetcher, bit-identical to an uninterrupted run; behind a proxy that adds a
first-byte latency, the prefetcher's requests in flight follow latency x consumption within the local byte bound."""
from __future__ import annotations

import contextlib
import copy
import fnmatch
import http.server
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from support.delay_proxy import START_S, DelayProxy
from support.pipeline import checkpoint_iterations, checkpoints, kill9_training_after, stage_cli, write_params
from detpipe import params as params_mod
from detpipe.data.dataset import CachedDetectionDataset
from detpipe.data.loader import micro_batches
from detpipe.data.sampler import ResumableDistributedSampler
from detpipe.engine.elastic import EpochPlan
from detpipe.data.streaming import START_DEPTH, ShardPrefetcher, wait_for_shard
from detpipe.core.errors import StageError
from detpipe.data.augment import build_cache
from detpipe.core.files import filesystem

SHARD_MB = 0.05  # ~2-3 JPEG images of 320x320 per shard: many shards from 12 images


@pytest.fixture(scope="module")
def small_shards(cached_workdir, tmp_path_factory) -> Path:
    cfg = params_mod.load("augment", cached_workdir / "params.yaml").model_copy(update={"shard_mb": SHARD_MB})
    out = tmp_path_factory.mktemp("small-shards") / "cache"
    build_cache(cached_workdir / "data/arrow", out, cfg)
    return out


@pytest.fixture(scope="module")
def remote(s3_server, small_shards):  # noqa: F811
    """The small-shard cache uploaded to a fresh bucket; yields ``(url, s3fs filesystem, bucket)`` with the
    server's credentials in the environment (pyarrow's S3 client reads them from there)."""
    bucket = s3_server.create_bucket()
    fs = s3_server.filesystem()
    fs.put(str(small_shards), f"{bucket}/cache", recursive=True)
    host = s3_server.endpoint_url.split("://", 1)[1]
    saved = {k: os.environ.get(k) for k in s3_server.env()}
    os.environ.update(s3_server.env())
    try:
        yield f"s3://{bucket}/cache?endpoint_override={host}&scheme=http", fs, bucket
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _sampler(ds: CachedDetectionDataset) -> ResumableDistributedSampler:
    return ResumableDistributedSampler(len(ds), seed=4, shards=ds.sample_shards(), window=2)


def _take(ds, n_steps: int, start: int = 0, watch=None, **kw) -> list:
    """Steps ``start ..`` of the training input (batch 2), positioned as the trainer does (no world-size change)."""
    gen = micro_batches(ds, _sampler(ds), EpochPlan(len(ds) // 2, 2).locate(start), 2, 1, **kw)
    out = []
    try:
        for _ in range(n_steps):
            out.append(next(gen)[0])
            if watch:
                watch(ds)
    finally:
        gen.close()
    return out


def _same(a, b) -> None:
    assert len(a) == len(b)
    for (ia, ta), (ib, tb) in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(ia, ib))
        assert all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(ta, tb))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_streamed_batches_equal_local_and_local_folder_stays_bounded(remote, small_shards, tmp_path, num_workers):
    url, _, _ = remote
    local = CachedDetectionDataset(small_shards, "train", hflip=0.5, seed=4)
    n_shards = len(local.shard_names())
    assert n_shards >= 4, "the test needs several shards"
    steps = 3 * (len(local) // 2)  # three epochs
    ref = _take(local, steps)
    shard_bytes = [f.stat().st_size for f in (small_shards / "train").glob("part-*.arrow")]
    bound = 4 * max(shard_bytes)  # 2 x window (2) shards: the working set at a block boundary
    ds = CachedDetectionDataset(url, "train", hflip=0.5, seed=4)
    held = []

    def watch(d):
        held.append(_folder_bytes(d.local_dir, "part-*.arrow"))

    got = _take(ds, steps, watch=watch, local_dir=str(tmp_path / "shards"), local_bytes=bound,
                num_workers=num_workers)
    _same(got, ref)
    assert max(held) <= bound, (max(held), bound)
    assert not list((tmp_path / "shards").iterdir())  # closed: copies deleted
    # whole shards, about once per epoch each (a shard spanning a block boundary of the plan may come twice)
    # -- counted through a fresh run's prefetcher
    ds2 = CachedDetectionDataset(url, "train", hflip=0.5, seed=4)
    gets = []
    _take(ds2, len(local) // 2, watch=lambda d: gets.append(d.prefetcher.gets), local_bytes=bound)
    assert n_shards <= gets[-1] <= 2 * n_shards, (gets[-1], n_shards)
    # resumed mid-way through epoch 2 from the bucket: the same batches as the uninterrupted local run
    k = len(local) // 2 + 1
    _same(_take(CachedDetectionDataset(url, "train", hflip=0.5, seed=4), steps - k, start=k, local_bytes=bound,
                num_workers=num_workers), ref[k:])


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_missing_or_corrupt_remote_shard_is_a_one_line_error_naming_its_url(remote, small_shards, damage):
    url, fs, bucket = remote
    victim = f"{bucket}/cache/train/part-00001.arrow"
    original = fs.cat(victim)
    try:
        if damage == "missing":
            fs.rm(victim)
        else:
            fs.pipe(victim, b"this is not an Arrow file" * 100)
        ds = CachedDetectionDataset(url, "train", hflip=0.5, seed=4)
        with pytest.raises(StageError) as e:
            _take(ds, 3 * (len(ds) // 2), num_workers=2 if damage == "corrupt" else 0)
        msg = str(e.value)
        assert "\n" not in msg and f"s3://{bucket}/cache/train/part-00001.arrow" in msg, msg
        assert ("not found" if damage == "missing" else "not a readable Arrow IPC file") in msg, msg
        assert "endpoint_override" not in msg
    finally:
        fs.pipe(victim, original)


DELAY_S = 0.1  # first-byte latency the proxy adds to every response (2 per shard copy: HEAD + GET)
COPIES = 8  # each real small shard stored under this many names: a plan over many shards
SAMPLES_PER_SHARD = 3
BOUND_SHARDS = 12  # the byte bound of the latency tests, in shards of the largest size


@pytest.fixture(scope="module")
def many_shards(remote, s3_server, small_shards) -> tuple[str, list[str], int]:
    """``(split URL path, shard names, largest shard's bytes)``: the real train shards of the small-shard cache,
    each stored `COPIES` times under new names in a fresh bucket (``<bucket>/many/train/part-NNNNN.arrow``)."""
    fs = s3_server.filesystem()
    bucket = s3_server.create_bucket()
    files = sorted((small_shards / "train").glob("part-*.arrow"))
    names = [f"part-{k:05d}.arrow" for k in range(COPIES * len(files))]
    for k, name in enumerate(names):
        fs.pipe(f"{bucket}/many/train/{name}", files[k % len(files)].read_bytes())
    return f"{bucket}/many/train", names, max(f.stat().st_size for f in files)


@pytest.fixture
def latency_proxy(s3_server):
    """A `DelayProxy` adding `DELAY_S` to each response of the test S3 server."""
    host, port = s3_server.endpoint_url.split("://", 1)[1].rsplit(":", 1)
    with DelayProxy((host, int(port)), delay_s=DELAY_S) as proxy:
        yield proxy


def test_delay_proxy_stops_quietly_with_connections_open(tmp_path, caplog):
    """`DelayProxy` (also behind ``benchmarks.s3_stream``) closed while one connection idles after a response and
    another waits for a delayed one: it returns promptly, both clients see the connection end, its thread ends,
    and asyncio logs nothing (no "Exception in callback" traceback). Upstream: a keep-alive HTTP file server."""
    (tmp_path / "f.bin").write_bytes(b"x" * 1000)

    class Handler(http.server.SimpleHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients use it

        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(tmp_path), **kw)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    request = b"GET /f.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    try:
        proxy = DelayProxy(server.server_address[:2])
        # each wait below is bounded by START_S (60 s), a bound for a loaded machine: 10 s timed out once under
        # three xdist workers on two cores
        idle = socket.create_connection(("127.0.0.1", proxy.port), timeout=START_S)
        idle.sendall(request)
        assert idle.recv(1 << 16).startswith(b"HTTP/1.1 200")  # answered; the connection stays open
        proxy.delay_s = 30
        waiting = socket.create_connection(("127.0.0.1", proxy.port), timeout=START_S)
        waiting.sendall(request)
        deadline = time.monotonic() + START_S
        while proxy.in_flight < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (proxy.in_flight, proxy.max_in_flight, proxy.responses) == (1, 1, 1)
        t0 = time.monotonic()
        proxy.close()
        assert time.monotonic() - t0 < 5 and not proxy._thread.is_alive()
        for conn in (idle, waiting):
            with contextlib.suppress(ConnectionError):
                assert not conn.recv(1 << 16).startswith(b"HTTP")  # ended (or reset) by the proxy
            conn.close()
    finally:
        server.shutdown()
        server.server_close()
    assert proxy.in_flight == 0
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.WARNING], caplog.text


def _folder_bytes(folder: Path | str, pattern: str = "*") -> int:
    """Bytes of the files in ``folder`` whose names match ``pattern``, from one consistent listing: the prefetcher renames ``*.tmp`` copies and
    deletes consumed shards while we look, so a file that vanishes between the listing and its ``stat`` means the
    listing is stale and is taken again (the bytes moved to the new name, they did not leave the folder)."""
    while True:
        try:
            with os.scandir(folder) as entries:
                return sum(e.stat().st_size for e in entries if e.is_file() and fnmatch.fnmatch(e.name, pattern))
        except FileNotFoundError:
            continue


def _consume_through_prefetcher(many_shards, proxy: DelayProxy, local_dir: Path, per_sample_s: float,
                                samples: int) -> tuple[int, int, int]:
    """Read ``samples`` samples of a shard-aware sampler's plan (`SAMPLES_PER_SHARD` samples per shard, block
    shuffle of 2 shards, epoch after epoch) through a `ShardPrefetcher` behind ``proxy``, bounded to `BOUND_SHARDS`
    shards, as a training loop spending ``per_sample_s`` seconds per sample would: wait for each sample's shard
    like the dataset's readers (and open it as an Arrow file), report consumed positions per batch of 2.
    Returns ``(most requests in flight at the proxy, most bytes in local_dir, the bound in bytes)``."""
    split, names, largest = many_shards
    url = f"s3://{split}?endpoint_override=127.0.0.1:{proxy.port}&scheme=http"
    sample_shard = np.repeat(np.arange(len(names)), SAMPLES_PER_SHARD)
    sampler = ResumableDistributedSampler(len(sample_shard), seed=4, shards=sample_shard, window=2)

    def plan():
        for epoch in range(samples // len(sample_shard) + 2):
            s = copy.copy(sampler)
            s.set_epoch(epoch)
            yield sample_shard[np.asarray(s.indices(), dtype=np.int64)]

    fs, path = filesystem(url)
    bound = BOUND_SHARDS * largest
    proxy.reset()
    prefetcher = ShardPrefetcher(fs, path, url, names, str(local_dir), bound, plan(), lookahead=2)
    most_bytes = 0
    try:
        for pos, shard in enumerate(np.concatenate(list(plan()))[:samples]):
            copy_path = wait_for_shard(str(local_dir), names[shard], url, timeout_s=60)
            assert ipc.open_file(pa.memory_map(copy_path)).num_record_batches > 0
            most_bytes = max(most_bytes, _folder_bytes(local_dir))
            time.sleep(per_sample_s)
            if pos % 2 == 1:
                prefetcher.consumed(pos + 1)
        assert prefetcher.error is None, prefetcher.error
    finally:
        prefetcher.close()
    return proxy.max_in_flight, most_bytes, bound


def test_requests_in_flight_grow_to_latency_times_consumption_within_the_byte_bound(many_shards, latency_proxy,
                                                                                      tmp_path):
    """A loop that consumes as fast as shards arrive needs, behind 2 x 100 ms per copy, more shards in flight than
    the byte bound holds: the requests in flight at the proxy must reach close to the bound (a fixed depth of 4
    copies in flight stays at 4), and the local folder never holds more than the bound."""
    in_flight, most_bytes, bound = _consume_through_prefetcher(many_shards, latency_proxy, tmp_path / "shards",
                                                               0.0, 2 * COPIES * 6 * SAMPLES_PER_SHARD)
    assert in_flight >= BOUND_SHARDS - 2 > 2 * START_DEPTH, (in_flight, BOUND_SHARDS)
    assert most_bytes <= bound, (most_bytes, bound)


def test_a_slow_consumer_keeps_few_requests_in_flight(many_shards, latency_proxy, tmp_path):
    """A loop consuming 5 samples/s (~2 shards/s) needs ~2 x 0.2 s x 5 = 2 samples requested ahead: after its
    start (`START_DEPTH` shards) the prefetcher keeps few copies in flight instead of filling the byte bound."""
    in_flight, most_bytes, bound = _consume_through_prefetcher(many_shards, latency_proxy, tmp_path / "shards",
                                                               0.2, 20)
    assert in_flight <= START_DEPTH, in_flight
    assert most_bytes <= bound // 2, (most_bytes, bound)


@pytest.mark.slow
def test_kill9_resume_through_the_prefetcher_is_bit_identical(remote, cached_workdir, tmp_path):
    """The train stage reading `train.cache_url` (small shards, a local folder bound of ~2 shards, a DataLoader
    worker alive across epochs) is killed with SIGKILL after its second checkpoint (of 4) and run again: its final
    weights equal an uninterrupted run's."""
    url, _, _ = remote
    overrides = {"train": {"epochs": 2, "checkpoint_every": 1, "keep_last": 10, "cache_url": url,
                           "num_workers": 1, "cache_local_bytes": 10**5}}

    def node(name: str) -> Path:
        work = tmp_path / name
        shutil.copytree(cached_workdir / "data/arrow", work / "data/arrow")
        write_params(work, overrides)
        return work

    straight = node("straight")
    stage_cli("train", straight)
    killed = node("killed")
    kill9_training_after(killed)          # returns once its workers are gone too
    assert len(checkpoints(killed)) < checkpoint_iterations(straight)[-1], "the kill came too late to test anything"
    assert "resuming from" in stage_cli("train", killed).stderr
    a = torch.load(straight / "models/model.pt", weights_only=True)["model"]
    b = torch.load(killed / "models/model.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
