"""What one server accepts and holds: `Limits`, the serve command's limit options (checked by `Limits.check`)."""
from __future__ import annotations

import dataclasses

from detpipe.core.errors import StageError

SCORE_THRESHOLD = 0.25   # predict's default (`detpipe.predict.SCORE_THRESHOLD`), repeated: the command line imports no torch


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one server accepts and holds (the command's options).

    ``max_bytes``: request body bytes (more: 413); ``max_pixels``: width x height an image may declare (more: 422,
    refused before decoding; also Pillow's ``Image.MAX_IMAGE_PIXELS`` in the server process); ``queue_size``:
    requests admitted and not yet in a batch (more: 503 with Retry-After); ``max_batch``: images per model call;
    ``max_wait_s``: seconds a batch waits to fill after its first image; ``workers``: decoding threads;
    ``score_threshold``: the default of the ``score_threshold`` query parameter, in [0, 1]; ``header_timeout_s``:
    seconds a served connection may take to send a request's headers (more: closed); ``body_timeout_s``: seconds
    from a request's headers to the end of its body (more: 408 and closed); ``keep_alive_s``: seconds an idle
    kept-alive connection is held (then closed). A timeout of 0 is off (for tests that show what it prevents)."""

    max_bytes: int = 16_000_000
    max_pixels: int = 40_000_000
    queue_size: int = 16
    max_batch: int = 8
    max_wait_s: float = 0.005
    workers: int = 2
    score_threshold: float = SCORE_THRESHOLD
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0

    def check(self) -> None:
        """Raises `StageError` naming the option of a value out of range."""
        for name, value, low in (("--max-bytes", self.max_bytes, 1), ("--max-pixels", self.max_pixels, 1),
                                 ("--queue-size", self.queue_size, 1), ("--max-batch", self.max_batch, 1),
                                 ("--workers", self.workers, 1), ("--max-wait-ms", self.max_wait_s * 1000, 0),
                                 ("--header-timeout", self.header_timeout_s, 0),
                                 ("--body-timeout", self.body_timeout_s, 0),
                                 ("--keep-alive-timeout", self.keep_alive_s, 0)):
            if value < low:
                raise StageError(f"{name} {value}: must be at least {low}")
        if not 0.0 <= self.score_threshold <= 1.0:
            raise StageError(f"--score-threshold {self.score_threshold}: must be in [0, 1] (scores are probabilities)")
