"""``python -m detpipe.serve --model PATH [options]``: the command line of `detpipe.serve.serve` (``--help``)."""
from __future__ import annotations

import argparse
import os

from detpipe.core.errors import run_program
from detpipe.serve import (DEFAULT_DATA, DEFAULT_HOST, DEFAULT_MODEL, DEFAULT_PORT, GRACEFUL_TIMEOUT_S, MAX_CONNECTIONS,
                           MAX_WAITING, Limits, serve)


def parser() -> argparse.ArgumentParser:
    """The command line's parser (``--help``)."""
    d = Limits()
    p = argparse.ArgumentParser(
        prog="python -m detpipe.serve",
        description="Serve the exported (ONNX, default) or trained (model.pt) detector over HTTP: POST /predict an "
                    "image (raw body or multipart), get its COCO results JSON as `python -m detpipe.predict` writes "
                    "them; GET /healthz, GET /readyz, GET /metrics (Prometheus), "
                    "POST /admin/reload (or SIGHUP: a new model without downtime).")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help=f"models/model.onnx (onnxruntime) or models/model.pt (eager PyTorch); default {DEFAULT_MODEL}")
    p.add_argument("--data", default=str(DEFAULT_DATA),
                   help="the run's data folder with arrow/meta.json (category ids and names) and cache/meta.json "
                        f"(resize rule) (default {DEFAULT_DATA})")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST}: this machine "
                                                        "only; there is no authentication)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port; 0: any free one (default {DEFAULT_PORT})")
    p.add_argument("--score-threshold", type=float, default=d.score_threshold,
                   help=f"default of the score_threshold query parameter, in [0, 1] (default {d.score_threshold})")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help=f"images per model call (default {d.max_batch})")
    p.add_argument("--max-wait-ms", type=float, default=d.max_wait_s * 1000,
                   help="milliseconds a batch waits to fill after its first image (default "
                        f"{d.max_wait_s * 1000:g})")
    p.add_argument("--queue-size", type=int, default=d.queue_size,
                   help=f"requests admitted and waiting for the model; more are answered 503 (default {d.queue_size})")
    p.add_argument("--max-bytes", type=int, default=d.max_bytes,
                   help=f"largest request body in bytes; larger is 413 (default {d.max_bytes})")
    p.add_argument("--max-pixels", type=int, default=d.max_pixels,
                   help=f"most pixels (width x height) an image may declare; more is 422, before decoding "
                        f"(default {d.max_pixels})")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="threads decoding and preparing images (default: CPU cores, at most 4)")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help=f"connections served at once; more wait for a slot (default {MAX_CONNECTIONS})")
    p.add_argument("--max-waiting", type=int, default=MAX_WAITING,
                   help=f"connections waiting for a slot; more get 503 at once (default {MAX_WAITING})")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds a connection may take to send a request's headers, else it is closed; 0: no limit "
                        f"(default {d.header_timeout_s:g})")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds from a request's headers to the end of its body, else 408 and the connection is "
                        f"closed; 0: no limit (default {d.body_timeout_s:g})")
    p.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_s,
                   help=f"seconds an idle kept-alive connection is held (default {d.keep_alive_s:g})")
    p.add_argument("--admin-remote", action="store_true",
                   help="accept POST /admin/reload from other machines (default: this machine only)")
    p.add_argument("--graceful-timeout", type=int, default=GRACEFUL_TIMEOUT_S,
                   help=f"seconds a SIGTERM/SIGINT waits for requests in flight (default {GRACEFUL_TIMEOUT_S})")
    p.add_argument("--access-log", action="store_true", help="log one line per request")
    return p


def main(argv: list[str] | None = None) -> None:
    """``python -m detpipe.serve``: parse the command line (``--help``) and run `detpipe.serve.serve`."""
    a = parser().parse_args(argv)
    limits = Limits(max_bytes=a.max_bytes, max_pixels=a.max_pixels, queue_size=a.queue_size, max_batch=a.max_batch,
                    max_wait_s=a.max_wait_ms / 1000, workers=a.workers, score_threshold=a.score_threshold,
                    header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout, keep_alive_s=a.keep_alive_timeout)
    serve(a.model, a.data, a.host, a.port, limits, a.max_connections, a.graceful_timeout, a.access_log,
          a.max_waiting, a.admin_remote)


if __name__ == "__main__":
    run_program(main, stage="serve")
