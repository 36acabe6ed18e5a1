"""Augment stage: decode every image once, resize it to the training size and cache it in Arrow (JPEG by default).

``python -m stages.augment`` reads ``data/arrow`` and writes ``data/cache`` (params section ``augment``). The work,
the cache's layout, encodings, resize modes, masks and copies are `detpipe.data.augment.build_cache`'s (see its
module docstring).
"""
from __future__ import annotations

from detpipe.data.augment import build_cache
from detpipe.core.errors import run_program
from detpipe.params import load
from detpipe.core.paths import ARROW_DIR, CACHE_DIR


def main() -> None:
    """``python -m stages.augment``: ``data/arrow`` -> ``data/cache`` with params section ``augment``."""
    build_cache(ARROW_DIR, CACHE_DIR, load("augment"))


if __name__ == "__main__":
    run_program(main)
