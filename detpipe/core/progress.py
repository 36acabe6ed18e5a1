"""Live progress: a tqdm bar on a terminal, a log line every few seconds elsewhere (Prefect run logs, CI, nohup)."""
from __future__ import annotations

import datetime
import logging
import sys
import time
from typing import Callable, Iterable, Iterator, TypeVar

from tqdm import tqdm

log = logging.getLogger("detpipe.core.progress")
T = TypeVar("T")

EVERY_S = 30.0  # default seconds between progress log lines (train.log_every_s)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _bytes(n: float) -> str:
    """``n`` bytes as tqdm shows them (binary prefixes): ``"512 B"``, ``"1.50 MiB"``."""
    for prefix in ("", "Ki", "Mi", "Gi"):
        if abs(n) < 1024:
            return f"{n:.2f} {prefix}B" if prefix else f"{n:.0f} B"
        n /= 1024
    return f"{n:.2f} TiB"


class Progress:
    """Progress of ``total`` units of work (iterations, batches, images, bytes) named ``desc``.

    On a TTY (``sys.stderr.isatty()``) a tqdm bar; otherwise `update` logs (logger ``detpipe.core.progress``, INFO)
    at most one line per ``every_s`` seconds, and always when the count reaches ``total``, e.g.::

        train: iteration 12/40, epoch 2/5, loss 1.234, lr 0.01, 3.2 images/s, ETA 0:01:23
        train2017.zip: 1.50 GiB/18.00 GiB, 41.20 MiB/s, ETA 0:06:50            (unit="B")

    images/s (bytes/s with ``unit="B"``) is over the interval since the previous line; the ETA is the remaining
    units times the mean seconds per unit since construction (or the last `reset`). ``total=None``: unknown (no
    ETA). ``enabled=False`` (e.g. ranks other than 0) makes every call a no-op. Usable as a context manager
    (`close` on exit).
    """

    def __init__(self, total: int | None, desc: str, every_s: float = EVERY_S, initial: int = 0,
                 unit: str = "iteration", enabled: bool = True, tty: bool | None = None):
        self.total, self.desc, self.every_s, self.unit, self.enabled = total, desc, every_s, unit, enabled
        self.n = self.start = self.n_last = initial
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.t0 = self.t_last = time.monotonic()
        self.images_since = 0
        self.last_line = ""
        byte = unit == "B"
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="B" if byte else "it", unit_scale=byte,
                        unit_divisor=1024, mininterval=2.0, dynamic_ncols=True) if enabled and self.tty else None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self, total: int | None, n: int = 0) -> None:
        """Start counting again (e.g. a transfer restarted or resumed at ``n``) towards ``total`` units."""
        if not self.enabled:
            return
        self.total, self.n = total, n
        self.start = self.n_last = n
        self.t0 = self.t_last = time.monotonic()
        self.images_since = 0
        if self.bar is not None:
            self.bar.reset(total=total)
            self.bar.update(n)

    def update(self, n: int = 1, images: int = 0, **fields) -> None:
        """``n`` more units done, covering ``images`` images; ``fields`` (e.g. ``epoch="2/5"``, ``loss=1.23``,
        ``lr=0.01``) are shown in the order given (floats with 4 significant digits)."""
        if not self.enabled:
            return
        self.n += n
        self.images_since += images
        if self.bar is not None:
            self.bar.set_postfix({k: _fmt(v) for k, v in fields.items()}, refresh=False)
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.t_last >= self.every_s or self.n == self.total:
            self._log(now, fields)

    def _log(self, now: float, fields: dict) -> None:
        byte = self.unit == "B"
        count = _bytes(self.n) if byte else f"{self.unit} {self.n}"
        if self.total is not None:
            count += f"/{_bytes(self.total) if byte else self.total}"
        parts = [count] + [f"{k.replace('_', ' ')} {_fmt(v)}" for k, v in fields.items()]
        if byte:
            parts.append(f"{_bytes((self.n - self.n_last) / max(now - self.t_last, 1e-9))}/s")
        if self.images_since:
            parts.append(f"{self.images_since / max(now - self.t_last, 1e-9):.1f} images/s")
        done = self.n - self.start
        if done and self.total is not None and self.n < self.total:
            eta = (now - self.t0) / done * (self.total - self.n)
            parts.append(f"ETA {datetime.timedelta(seconds=round(eta))}")
        self.last_line = f"{self.desc}: " + ", ".join(parts)
        log.info("%s", self.last_line)
        self.t_last, self.images_since, self.n_last = now, 0, self.n

    def close(self) -> None:
        """Close the bar (TTY); idempotent."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def track(iterable: Iterable[T], desc: str, total: int | None = None, images: Callable[[T], int] | None = None,
          every_s: float = EVERY_S, unit: str = "batch") -> Iterator[T]:
    """Yield the items of ``iterable`` while showing a `Progress` over them; ``total`` defaults to
    ``len(iterable)``, ``images(item)`` (optional) counts an item's images for the images/s figure."""
    progress = Progress(len(iterable) if total is None else total, desc, every_s, unit=unit)
    try:
        for item in iterable:
            yield item
            progress.update(1, images(item) if images else 0)
    finally:
        progress.close()
