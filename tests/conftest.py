"""Fixtures shared by the test modules; the helpers they use live in ``tests/support`` (no test module imports
another). What is expensive is built once per test run and reused:

* ``cached_workdir`` / ``trained_workdir`` / ``two_rank_workdir``: 12 COCO128 images through the real convert,
  augment and train stages' CLIs (tiny params);
* ``reproduced_repo``: a git + DVC copy of the repository after ``dvc repro`` of the whole default pipeline (12
  images, tiny params): every test that needs pipeline outputs in a repository starts from a copy of it
  (`support.repos.clone_with_cache`), so each stage's real run through DVC is proven once;
* ``s3_server``: SeaweedFS S3; ``prefect_api``: one Prefect server for every Prefect test.

Everything the tests start carries this run's token in its environment and dies with the pytest process,
even a SIGKILLed one (`support.reaper`).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from support.pipeline import elastic_workdir, make_coco_subset, stage_cli, write_params
from support.procs import run


def pytest_configure(config):
    # Tag everything the tests start (os.environ["DETPIPE_TEST_RUN"]) and start a watchdog that kills it when
    # this pytest process exits, even by SIGKILL. Main process only, not in an xdist worker.
    if not hasattr(config, "workerinput"):
        from support import reaper
        reaper.start()


@pytest.fixture(scope="session")
def cached_workdir(tmp_path_factory) -> Path:
    """A working directory with ``params.yaml`` (tiny), ``data/raw`` (12 COCO128 images), and the real
    convert and augment stages' outputs ``data/arrow`` and ``data/cache``. Tests must not modify it."""
    work = tmp_path_factory.mktemp("cached")
    write_params(work)
    make_coco_subset(work / "data" / "raw")
    stage_cli("convert", work)
    stage_cli("augment", work)
    return work


@pytest.fixture(scope="session")
def trained_workdir(tmp_path_factory, cached_workdir) -> Path:
    """A copy of `cached_workdir` after the real train stage (tiny params, 1 process)."""
    work = tmp_path_factory.mktemp("trained")
    shutil.copytree(cached_workdir, work, dirs_exist_ok=True)
    stage_cli("train", work)
    return work


@pytest.fixture(scope="session")
def two_rank_workdir(tmp_path_factory, cached_workdir) -> Path:
    """An uninterrupted single-node train run with 2 worker processes (world size 2) and ``ELASTIC_TRAIN``."""
    work = elastic_workdir(cached_workdir, tmp_path_factory.mktemp("two_ranks"), {"nproc_per_node": 2})
    stage_cli("train", work)
    return work


# The default pipeline's params in `reproduced_repo`: a 12-image dataset (pinned by its sha256), one epoch.
REPRODUCED_PARAMS = {"train": {"epochs": 1}}


@pytest.fixture(scope="session")
def reproduced_repo(tmp_path_factory) -> Path:
    """A git + DVC copy of the repository (`support.repos.make_repo` with ``REPRODUCED_PARAMS`` and the default
    export, torch.export included) after ``dvc repro`` of the whole pipeline, the run committed ("pipeline
    run"). Tests must not modify it: copy it with `support.repos.clone_with_cache`."""
    from support.repos import make_repo

    repo = make_repo(tmp_path_factory.mktemp("reproduced") / "repo", train=REPRODUCED_PARAMS["train"],
                     export={"torch_export": True})
    run(["dvc", "repro"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "pipeline run"], repo)
    return repo


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Session-scoped SeaweedFS S3 server on 127.0.0.1 (`support.s3server.running_s3_server`); yields an
    `support.s3server.S3Server`."""
    from support.s3server import running_s3_server

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with running_s3_server(tmp_path_factory.mktemp("s3server")) as server:
        yield server


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> Iterator:
    """One Prefect server for every Prefect test of the run (`support.prefect.prefect_server`: SQLite in a
    temporary ``PREFECT_HOME``, a free loopback port, the shortest safe heartbeat settings); yields its
    `support.prefect.Prefect`. Modules add their serve/worker processes to ``procs`` and stop them at their end."""
    from support.prefect import prefect_server

    with prefect_server(tmp_path_factory.mktemp("prefect_home")) as prefect:
        yield prefect


@pytest.fixture(scope="session")
def learns_prepared(tmp_path_factory) -> Path:
    """`support.pipeline.make_learns_workdir` (4 COCO128 images, 4 classes, train = val) after the real convert and
    augment stages' CLIs. Tests must not modify it."""
    from support.pipeline import make_learns_workdir

    work = tmp_path_factory.mktemp("learns") / "w"
    work.mkdir()
    make_learns_workdir(work)
    for stage in ("convert", "augment"):
        stage_cli(stage, work)
    return work


@pytest.fixture(scope="session")
def fitted_workdir(tmp_path_factory, learns_prepared) -> Path:
    """A copy of `learns_prepared` after the real train (150 iterations: the detector fits the 4 images, see
    tests/test_learns.py) and evaluate stages: ``models/model.pt``, ``metrics/eval.json``. Tests must not modify
    it: copy it (a few MB)."""
    work = tmp_path_factory.mktemp("fitted") / "w"
    shutil.copytree(learns_prepared, work)
    stage_cli("train", work, timeout=1800)
    stage_cli("evaluate", work)
    return work
