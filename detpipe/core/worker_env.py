"""The environment the launcher hands its workers: the names of the variables `detpipe.launch` sets for every
worker and `detpipe.engine` reads inside one. Both sides import this module, neither imports the other
(tests/unit/test_layout.py).
"""
from __future__ import annotations

COLLECTIVE_TIMEOUT_ENV = "DETPIPE_COLLECTIVE_TIMEOUT_S"
"""Environment variable carrying ``train.collective_timeout_s`` (seconds, a positive number) to the workers: set by
`detpipe.launch.torchrun_args.launch_env`, read by `detpipe.core.distributed.collective_timeout_s`."""
