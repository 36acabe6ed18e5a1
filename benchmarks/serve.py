"""Benchmark: `python -m detpipe.serve` under load, micro-batching against one image per model call, same model,
same images, same run, every answer checked against `detpipe.predict` offline.

First predict runs offline over the folder (default ``data/coco128/train2017``, 128 images; ``--batch-size`` 8,
no drawn images, the default score threshold) after a warm-up on 8 images, ``--repeats`` times: its predictions
are the reference (its images/s is printed too). Then the real server starts twice, both up at once (a
subprocess each on a free loopback port, a queue of at least ``--clients``; ready when ``/readyz`` says so): one
with ``--max-batch 1`` (the baseline: every image its own model call), one with ``--max-batch <--batch-size>``. In
each of ``--repeats`` rounds, each server in turn (interleaved: a loaded machine's drift hits both alike) gets
``--clients`` concurrent clients (asyncio + httpx, one connection each) that POST ``--requests`` images in turn
over the folder's files (the raw bytes, with predict's image id and file name), after one warm-up request per
client; the fastest round of each counts. Every answer is checked: status 200, JSON, and equal to
predict's predictions for that image (same detections, order, ids and categories; boxes within 1e-3 px and scores
within 1e-5: a batch of several images rounds a few floats differently). Any other answer, or a request that
fails, is counted and the benchmark fails. Each server is stopped with SIGTERM and must exit with status 0.

    python -m benchmarks.serve [--workdir .] [--model models/model.onnx] [--clients 8] [--requests 256] [--repeats 2]

``--workdir`` holds ``models/`` and ``data/`` (``arrow/meta.json``, ``cache/meta.json``) of a pipeline run; e.g. a
copy of the ``fitted_workdir`` test fixture's folder (tests/conftest.py) and ``--model models/model.pt``.

Prints, for each server, served images/s, the latency percentiles (p50, p99, max; client-side, request sent to
answer parsed) and the batch sizes the server formed; the offline images/s; the load average; and as the last
line ``ratio: <served images/s at --max-batch <--batch-size> / served images/s at --max-batch 1>`` at
``--clients`` clients. With an ONNX file of a batched graph (SSD/SSDlite, RT-DETRv2, D-FINE: `detpipe.export.batched`),
its runner (and the int8 and OpenVINO ones) runs a micro-batch as one call; a one-image graph runs it image by
image. The clients share the machine's cores with the server (on this 2-core machine they take a
visible part of it).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._workdir import add_model_args  # noqa: E402
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402

from detpipe.predict import BATCH_SIZE, list_sources, predict  # noqa: E402
from support.serve import results_differ, running_server  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def load(url: str, bodies: list[tuple[str, int, bytes]], clients: int, requests: int, reference: dict
               ) -> tuple[float, list[float], collections.Counter, list[str]]:
    """``clients`` concurrent clients POST ``requests`` images (``bodies[i % len(bodies)]``: name, predict's image
    id, bytes) to ``url``/predict; returns (wall seconds, latencies in seconds, batch sizes, problems)."""
    latencies: list[float] = []
    batches: collections.Counter = collections.Counter()
    problems: list[str] = []
    counter = iter(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        for i in counter:
            name, image_id, data = bodies[i % len(bodies)]
            t0 = time.perf_counter()
            try:
                r = await http.post("/predict", content=data, params={"image_id": image_id, "file_name": name})
                answer = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                problems.append(f"request {i} ({name}): {type(e).__name__}: {e}")
                continue
            latencies.append(time.perf_counter() - t0)
            if answer is None:
                problems.append(f"request {i} ({name}): {r.status_code} {r.text[:200]}")
                continue
            batches[int(r.headers["X-Batch-Size"])] += 1
            why = results_differ(answer, reference[name])
            if why:
                problems.append(f"request {i} ({name}): {why}")

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        await asyncio.gather(*(http.post("/predict", content=bodies[i % len(bodies)][2]) for i in range(clients)))
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return wall, latencies, batches, problems


def serve_interleaved(model: Path, data: Path, logs: Path, sizes: tuple[int, ...], args, bodies: list,
                      reference: dict) -> tuple[dict, list[str]]:
    """Start one server per ``--max-batch`` of ``sizes`` (all up at once: an idle one waits on its socket), then
    ``args.repeats`` rounds in which each server in turn gets one `load` (batch 1, batch B, batch 1, ...: the
    machine's load drifts alike for both), then stop them (SIGTERM). Returns ``({max_batch: {"ips", "wall",
    "latencies", "batches" of its fastest round, "rounds": images/s of every round, "problems", "load": load average
    before and after}}, problems of the servers' exits)``."""
    import contextlib

    out: dict[int, dict] = {m: {"rounds": [], "problems": [], "all": []} for m in sizes}
    exits: list[str] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for m in sizes:
            options = ("--max-batch", str(m), "--max-wait-ms", str(args.max_wait_ms),
                       "--queue-size", str(max(16, args.clients)), "--max-connections", str(max(32, 2 * args.clients)))
            servers[m] = stack.enter_context(running_server(model, data, logs / f"serve-{m}.log", *options))
        load_before = os.getloadavg()[0]
        for r in range(args.repeats):
            for m, server in servers.items():
                wall, latencies, batches, found = asyncio.run(load(server.url, bodies, args.clients, args.requests,
                                                                   reference))
                out[m]["problems"] += found
                out[m]["all"].append((wall, latencies, batches))
                out[m]["rounds"].append(len(latencies) / wall)
                print(f"round {r + 1}, served --max-batch {m}: {len(latencies)} answers in {wall:.2f} s "
                      f"({len(latencies) / wall:.2f} images/s); load average {os.getloadavg()[0]:.2f}", flush=True)
        load_after = os.getloadavg()[0]
        for m, server in servers.items():
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(timeout=120)
            text = server.log_text()
            if code != 0 or "Traceback" in text:
                exits.append(f"server (--max-batch {m}) exit status {code} after SIGTERM; log tail:\n{text[-2000:]}")
    for m, r in out.items():
        wall, latencies, batches = min(r.pop("all"), key=lambda x: x[0])
        r.update(ips=len(latencies) / wall, wall=wall, latencies=latencies, batches=batches,
                 load=(load_before, load_after))
    return out, exits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, ROOT)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="predict's batch and the server's --max-batch")
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=2, help="offline runs and served rounds; the fastest counts")
    args = ap.parse_args()

    model, data = args.workdir / args.model, args.workdir / "data"
    files = list_sources(args.source)
    print(f"{len(files)} files from {args.source}; model {model}; {args.clients} clients, {args.requests} requests; "
          f"CPUs {os.cpu_count()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="detpipe-bench-serve-") as tmp:
        tmp = Path(tmp)
        warm = tmp / "warm"
        warm.mkdir()
        for f in files[:8]:
            (warm / f.file_name).write_bytes(f.read())
        predict(str(warm), model, tmp / "warm-out", batch_size=args.batch_size, data_dir=data, draw_images=False)
        offline_ips = 0.0
        for _ in range(args.repeats):
            report = predict(args.source, model, tmp / "offline", batch_size=args.batch_size, data_dir=data,
                             draw_images=False)
            offline_ips = max(offline_ips, report["images_per_s"])
            print(f"offline predict: {report['num_images']} images in {report['seconds']:.2f} s "
                  f"({report['images_per_s']:.2f} images/s), {report['num_detections']} detections", flush=True)
        preds = json.loads((tmp / "offline" / "predictions.json").read_text())
        reference = {im["file_name"]: [p for p in preds if p["image_id"] == im["id"]] for im in report["images"]}
        bodies = [(im["file_name"], im["id"], (Path(args.source) / im["file_name"]).read_bytes())
                  for im in report["images"]]

        served, problems = serve_interleaved(model, data, tmp, (1, args.batch_size), args, bodies, reference)
        for r in served.values():
            problems += r["problems"]
    for max_batch, r in served.items():
        ms = [s * 1000 for s in r["latencies"]]
        print(f"served --max-batch {max_batch} (fastest round): {len(ms)} answers in {r['wall']:.2f} s "
              f"({r['ips']:.2f} images/s); latency p50 {percentile(ms, 50):.0f} ms, p99 {percentile(ms, 99):.0f} ms, "
              f"max {max(ms):.0f} ms, mean {statistics.fmean(ms):.0f} ms; batch sizes (answers per size): "
              f"{dict(sorted(r['batches'].items()))}; every round: {', '.join(f'{x:.2f}' for x in r['rounds'])} images/s")
    print(f"load average {served[1]['load'][0]:.2f} before the served rounds, {served[1]['load'][1]:.2f} after")
    print(f"offline predict (fastest, --batch-size {args.batch_size}): {offline_ips:.2f} images/s")
    checked = 2 * args.repeats * args.requests
    print(f"checked: {checked} requests, {len(problems)} problems (not 200, not JSON, or not predict's answer)")
    for p in problems[:20]:
        print(f"  {p}")
    if problems:
        sys.exit(f"error: {len(problems)} of {checked} requests were not answered as predict answers")
    print(f"served --max-batch {args.batch_size} / served --max-batch 1 at {args.clients} clients, images/s:")
    print(f"ratio: {served[args.batch_size]['ips'] / served[1]['ips']:.2f}")


if __name__ == "__main__":
    main()
