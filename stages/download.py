"""Download stage: fetch the raw dataset into ``data/raw/`` (``python -m stages.download``).

The source (params ``download.source``) is a folder, an archive or a file, local or ``file://``/``s3://``/
``http(s)://``, or a list of such parts each with its own sha256, merged into one ``data/raw``; it is checked
against its sha256 and written atomically. The work is
`detpipe.data.download.download_raw` (its module docstring says how). ``--print-sha256 SOURCE`` prints the value
for ``download.sha256`` instead (`detpipe.data.download.print_sha256`).
"""
from __future__ import annotations

import argparse
from typing import Optional

from detpipe.data.download import download_raw, print_sha256
from detpipe.core.errors import run_program
from detpipe.params import load


def main(argv: Optional[list[str]] = None) -> None:
    """Run the stage (params section ``download``), or with ``--print-sha256 SOURCE`` print its sha256."""
    ap = argparse.ArgumentParser(prog="python -m stages.download", description=__doc__.splitlines()[0])
    ap.add_argument("--print-sha256", metavar="SOURCE",
                    help="print the sha256 of a file, or the manifest sha256 of a folder, and exit")
    ap.add_argument("--endpoint-url", default=None, help="S3 endpoint for --print-sha256 (default: params)")
    args = ap.parse_args(argv)
    if args.print_sha256:
        print_sha256(args.print_sha256, args.endpoint_url)
    else:
        download_raw(load("download"))


if __name__ == "__main__":
    run_program(main)
