"""Serve the trained or exported detector over HTTP: ``python -m detpipe.serve --model PATH [--data DIR] [options]``.

Endpoints (every answer is JSON; docs/serve.md has examples):

* ``POST /predict``: one image, as the raw request body (any content type but multipart) or as the file part of a
  ``multipart/form-data`` form. The answer is the image's COCO results exactly as ``python -m detpipe.predict``
  writes them for that image (`detpipe.predict.Predictor`: the same model runner, `detpipe.predict.prepare`'s
  preprocessing, ``bbox`` ``[x, y, w, h]`` float in original-image pixels, the dataset's ``category_id`` and
  ``category_name``, ``score`` in [0, 1], highest first), a JSON list. Query parameters: ``image_id`` (int, default 1,
  as predict numbers a one-image source), ``file_name`` (default: the multipart part's file name, else ``image``),
  ``score_threshold`` (in [0, 1], default ``--score-threshold``). Headers ``X-Batch-Size``: the micro-batch the
  image ran in; ``X-Model-Version``: the version of the model it ran on.
* ``GET /healthz``: 200 while the process serves (liveness).
* ``GET /readyz``: 200 once the model is loaded and has run once (warm-up), 503 before; the body gives the model,
  its version (the first 12 hex digits of its file's sha256), the runtime and the queue's counters.
* ``GET /metrics``: Prometheus text exposition (`detpipe.serve.metrics`): requests by route and status, latency and
  batch-size histograms, queue depth, connections, slow clients closed, reloads, the model's version.
* ``POST /admin/reload`` (from loopback addresses only unless ``--admin-remote``), or SIGHUP: load a new model file
  (JSON body ``{"model": "<path or exp:name>"}``; empty: the served file again), warm it up while the old one
  serves, then swap; requests in flight finish on the old model (`detpipe.serve.app.Service.reload`).

Limits (each refusal is ``{"error": "<one line>"}``, never a traceback): a body over ``--max-bytes`` is 413 (a
``Content-Length`` over it is refused unread); an image whose header declares more than ``--max-pixels`` pixels is
422 before any pixel is decoded (decompression bombs; Pillow's ``Image.MAX_IMAGE_PIXELS`` is set to the same limit);
a body that is no image of `detpipe.serve.intake.ACCEPTED_FORMATS` is 415, a corrupt one 400; an unknown route 404, a
wrong method 405. Requests are admitted into a bounded queue (``--queue-size``) and run by one model worker in
micro-batches (``--max-batch`` images, waiting at most ``--max-wait-ms`` for a batch to fill:
`detpipe.serve.batcher.Batcher`); a request is admitted only once its body is read and decoded, and one that finds
the queue full is answered 503 with ``Retry-After`` at once. Slow and idle clients: a connection must send its
request headers within ``--header-timeout`` seconds and its body within ``--body-timeout`` seconds of them (else
it is closed, with a logged line; the body timeout answers 408 first), an idle kept-alive connection is closed
after ``--keep-alive-timeout``; at most ``--max-connections`` are served at once, up to ``--max-waiting`` more wait
for a slot (accepted, not read), beyond that a connection gets 503 at once (`detpipe.serve.connections`).

Built on uvicorn (the ASGI server) and Starlette (the application), which the pipeline already ships as Prefect's
server. Binds 127.0.0.1 unless ``--host`` says otherwise (there is no authentication); SIGTERM or SIGINT stops it
gracefully (no new connections, requests in flight answered, at most ``--graceful-timeout`` seconds) with exit
status 0; it starts no process. A missing model or data meta file, a port in use or a model that cannot be loaded
is a one-line error (exit status 2).

The package: `serve` here (the server's run), `detpipe.serve.limits` (`Limits`, its options),
`detpipe.serve.app` (the routes and the service behind them: loading, reloading), `detpipe.serve.intake` (a
request's body, limits and decoding), `detpipe.serve.served` (a loaded model, its version, ``exp:<name>``),
`detpipe.serve.batcher` (the bounded queue and its model worker), `detpipe.serve.connections`
(the connection slots and the header timeout), `detpipe.serve.metrics` (``/metrics``), ``__main__`` (the command
line).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import warnings
from pathlib import Path

from detpipe.core.errors import StageError
from detpipe.serve.limits import SCORE_THRESHOLD, Limits  # noqa: F401 - the command's options, re-exported here

log = logging.getLogger("detpipe.serve")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MAX_CONNECTIONS = 32
MAX_WAITING = 256          # connections accepted beyond --max-connections, waiting for a slot; more get 503
GRACEFUL_TIMEOUT_S = 10
# predict's defaults (`detpipe.predict.DEFAULT_MODEL`, ``DEFAULT_DATA``; ``SCORE_THRESHOLD`` in
# `detpipe.serve.limits`), repeated so that the command line and its option errors do not import torch
DEFAULT_MODEL = Path("models/model.onnx")
DEFAULT_DATA = Path("data")


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 when ``host`` has a ``:``; ``SO_REUSEADDR``), not yet listening.

    Raises:
        StageError: the address cannot be bound (in use, not local, no permission), naming it.
    """
    from detpipe.core.net import bind_listener

    try:
        return bind_listener(host, port, backlog=None)
    except OSError as e:
        raise StageError(f"{host}:{port}: cannot listen there ({e.strerror or e})") from None


def serve(model_path: Path | str = DEFAULT_MODEL, data_dir: Path | str = DEFAULT_DATA, host: str = DEFAULT_HOST,
          port: int = DEFAULT_PORT, limits: Limits | None = None, max_connections: int = MAX_CONNECTIONS,
          graceful_timeout_s: int = GRACEFUL_TIMEOUT_S, access_log: bool = False, max_waiting: int = MAX_WAITING,
          admin_remote: bool = False) -> None:
    """Serve ``model_path`` until SIGTERM or SIGINT (see the module docstring). Call it from the main thread: it
    sets the SIGTERM and SIGINT handlers (uvicorn's, while it serves) and SIGHUP's (reload the model).

    Args:
        model_path: ``.onnx`` or ``.pt`` (`detpipe.predict.load_runner`).
        data_dir: the run's data folder (``arrow/meta.json``, ``cache/meta.json``: `detpipe.predict.data_meta`).
        host, port: where to listen (port 0: any free port, logged).
        limits: `Limits` (default: its defaults).
        max_connections: connections served at once; more wait for a slot (`detpipe.serve.connections`).
        graceful_timeout_s: seconds a stop waits for requests in flight.
        access_log: log one line per request.
        max_waiting: connections waiting for a slot; more get 503 at once.
        admin_remote: accept ``POST /admin/reload`` from other machines (default: loopback only).
    Raises:
        StageError: bad options, a missing model file or data meta file, an address that cannot be bound, or a
            model that cannot be loaded (after listening: the server stops).
    """
    limits = limits or Limits()
    limits.check()
    if max_connections < 1:
        raise StageError(f"--max-connections {max_connections}: must be at least 1")
    if max_waiting < 0:
        raise StageError(f"--max-waiting {max_waiting}: must be at least 0")
    model_path, data_dir = Path(model_path), Path(data_dir)
    if not model_path.is_file():
        raise StageError(f"{model_path}: model not found (run the pipeline, `dvc repro`, or pass --model "
                         "models/model.onnx or models/model.pt)")
    sock = listen_socket(host, port)   # before the heavy imports: a bad option or address fails in a second
    try:
        _serve(sock, model_path, data_dir, host, limits, max_connections, graceful_timeout_s, access_log,
               max_waiting, admin_remote)
    finally:
        sock.close()


def _serve(sock: socket.socket, model_path: Path, data_dir: Path, host: str, limits: Limits, max_connections: int,
           graceful_timeout_s: int, access_log: bool, max_waiting: int = MAX_WAITING,
           admin_remote: bool = False) -> None:
    """`serve` once its socket is bound."""
    import uvicorn
    from PIL import Image

    from detpipe.predict import data_meta, load_predictor
    from detpipe.serve.app import Service, create_app
    from detpipe.serve.connections import ConnectionGate, gated_protocol
    from detpipe.serve.metrics import Metrics

    data_meta(data_dir)      # the data meta files now, as one-line errors, before the model loads
    # Decode limits, explicitly: Pillow refuses (an error, not its default warning) any image over the limit.
    Image.MAX_IMAGE_PIXELS = limits.max_pixels
    warnings.simplefilter("error", Image.DecompressionBombWarning)
    bound = sock.getsockname()[1]
    server: uvicorn.Server | None = None
    stop: list[int] = []

    def fatal(reason: str) -> None:
        log.error("serve: %s: stopping", reason)
        server.should_exit = True

    def on_signal(signum, frame) -> None:
        # Before and after uvicorn's own handlers (it re-raises the signal it stopped on when it is done).
        stop.append(signum)
        if server is not None:
            server.should_exit = True

    gate = ConnectionGate(max_connections, max_waiting)
    service_box: list = []
    metrics = Metrics(lambda: service_box[0].batcher.pending if service_box else 0,
                      lambda: (len(gate.active), len(gate.waiting)))
    service = Service(lambda path: load_predictor(path, data_dir), limits, str(model_path), fatal, metrics,
                      admin_remote)
    service_box.append(service)
    protocol = gated_protocol(gate, limits.header_timeout_s, lambda phase: metrics.slow_clients.labels(phase).inc())
    config = uvicorn.Config(create_app(service), host=host, port=bound, loop="asyncio", http=protocol, ws="none",
                            lifespan="on", log_config=None, access_log=access_log, limit_concurrency=None,
                            timeout_keep_alive=limits.keep_alive_s, timeout_graceful_shutdown=graceful_timeout_s,
                            server_header=False)
    server = uvicorn.Server(config)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    # SIGHUP reloads the model while the application runs (its lifespan sets the handler); before and after, it is
    # logged and ignored instead of its default action (ending the process).
    signal.signal(signal.SIGHUP, lambda signum, frame: log.warning("serve: SIGHUP while not serving: ignored"))
    if host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("serve: listening on %s: reachable from other machines, with no authentication", host)
    log.info("serve: listening on http://%s:%d (pid %d); loading %s", host if ":" not in host else f"[{host}]", bound,
             os.getpid(), model_path)
    asyncio.run(server.serve(sockets=[sock]))
    if service.failed:
        raise StageError(service.failed)
    how = f"by {signal.Signals(stop[0]).name}" if stop else "its own"
    log.info("serve: stopped %s; answered %d requests", how, server.server_state.total_requests)
