"""Fixtures shared by the test modules; the helpers they use live in ``tests/support`` (no test module imports
another). What is expensive is built once per test run and reused:

* ``cached_workdir`` / ``trained_workdir`` / ``two_rank_workdir``: 12 COCO128 images through the real convert,
  augment and train stages' CLIs (tiny params);
* ``reproduced_repo``: a git + DVC copy of the repository after ``dvc repro`` of the whole default pipeline (12
  images, tiny params): every test that needs pipeline outputs in a repository starts from a copy of it
  (`support.repos.clone_with_cache`), so each stage's real run through DVC is proven once;
* ``s3_server``: SeaweedFS S3; ``prefect_api``: one Prefect server for every Prefect test;
* ``learns_prepared`` / ``fitted_workdir``: the learns test's 4 images, and the detector that fits them;
  ``learns_detr_prepared`` / ``fitted_detr_workdir``: the same at 128 px, and ``rtdetr_v2_tiny`` fitting them;
  ``fitted_dfine_workdir``: ``dfine_tiny`` fitting them at 192 px.

The session fixtures in `PREBUILT` that the selected tests use are built ahead of need, one at a time, by a
background thread while the first tests run (`support.prebuild`). Under pytest-xdist (``-n 2``, README command 2)
each module runs whole on one worker (`pytest_xdist_make_scheduler`), the shared fixtures are built once for both
workers, and the servers once per worker that needs them.

Everything the tests start carries this run's token in its environment and dies with the pytest process,
even a SIGKILLed one (`support.reaper`).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from support import prebuild
from support.pipeline import elastic_workdir, make_coco_subset, stage_cli, write_params
from support.procs import run


def pytest_configure(config):
    # Tag everything the tests start (os.environ["DETPIPE_TEST_RUN"]) and start a watchdog that kills it when
    # this pytest process exits, even by SIGKILL. Under xdist, in the controller and in each worker (whose token
    # is appended to the controller's): a worker's processes die with it or with the controller, and each worker
    # has its own `reaper.guard_dir` list.
    from support import reaper
    reaper.start()
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        # Under xdist (before the workers start, so they and all they start inherit it): one intra-op thread per
        # process unless set; N workers already keep N cores busy, and a second OpenMP thread in evaluate or
        # export only spins on a core the other worker needs (~15 % more CPU per evaluate run).
        os.environ.setdefault("OMP_NUM_THREADS", "1")


# ---------------------------------------------------------------------------------------------- builds

def _cached_workdir(factory) -> Path:
    work = factory.mktemp("cached")
    write_params(work)
    make_coco_subset(work / "data" / "raw")
    stage_cli("convert", work)
    stage_cli("augment", work)
    return work


def _trained_workdir(factory) -> Path:
    work = factory.mktemp("trained")
    shutil.copytree(prebuild.get("cached_workdir"), work, dirs_exist_ok=True)
    stage_cli("train", work)
    return work


def _two_rank_workdir(factory) -> Path:
    work = elastic_workdir(prebuild.get("cached_workdir"), factory.mktemp("two_ranks") / "w", {"nproc_per_node": 2})
    proc = stage_cli("train", work)
    (work.parent / TWO_RANK_LOG).write_text(proc.stderr)
    return work


# The stderr of `two_rank_workdir`'s train run, beside it (``two_rank_workdir.parent / TWO_RANK_LOG``).
TWO_RANK_LOG = "two_rank_train.log"


# The default pipeline's params in `reproduced_repo`: a 12-image dataset (pinned by its sha256), one epoch.
REPRODUCED_PARAMS = {"train": {"epochs": 1}}
# `dvc repro`'s stdout and stderr in one stream, beside the repository (``reproduced_repo.parent / REPRODUCED_LOG``).
REPRODUCED_LOG = "dvc_repro.log"


def _reproduced_repo(factory) -> Path:
    from support.repos import make_repo

    repo = make_repo(factory.mktemp("reproduced") / "repo", train=REPRODUCED_PARAMS["train"],
                     export={"torch_export": True})
    import subprocess
    from support.procs import stage_env

    proc = subprocess.run(["dvc", "repro"], cwd=repo, env=stage_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=1800)   # one stream: stages' logs in order
    (repo.parent / REPRODUCED_LOG).write_text(proc.stdout)
    assert proc.returncode == 0, f"dvc repro failed ({proc.returncode}):\n{proc.stdout[-6000:]}"
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "pipeline run"], repo)
    return repo


def _prefect_api(factory):
    from support.prefect import prefect_server

    return prebuild.enter(prefect_server(factory.mktemp("prefect_home")))    # stopped at the end of the session


def _s3_server(factory):
    from support.s3server import running_s3_server

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    return prebuild.enter(running_s3_server(factory.mktemp("s3server")))     # stopped at the end of the session


def _learns_prepared(factory) -> Path:
    from support.pipeline import make_learns_workdir

    work = factory.mktemp("learns") / "w"
    work.mkdir()
    make_learns_workdir(work)
    for stage in ("convert", "augment"):
        stage_cli(stage, work)
    return work


def _fitted_workdir(factory) -> Path:
    work = factory.mktemp("fitted") / "w"
    shutil.copytree(prebuild.get("learns_prepared"), work)
    stage_cli("train", work, timeout=1800)
    stage_cli("evaluate", work)
    return work


def _learns_detr_prepared(factory) -> Path:
    from support.pipeline import make_learns_detr_workdir

    return make_learns_detr_workdir(prebuild.get("learns_prepared"), factory.mktemp("learns_detr") / "w")


def _fitted_detr_workdir(factory) -> Path:
    work = factory.mktemp("fitted_detr") / "w"
    shutil.copytree(prebuild.get("learns_detr_prepared"), work)
    stage_cli("train", work, timeout=1800)
    stage_cli("evaluate", work)
    return work


def _learns_dfine_prepared(factory) -> Path:
    from support.pipeline import LEARNS_DFINE, make_learns_detr_workdir

    return make_learns_detr_workdir(prebuild.get("learns_prepared"), factory.mktemp("learns_dfine") / "w",
                                    LEARNS_DFINE)


def _fitted_dfine_workdir(factory) -> Path:
    work = factory.mktemp("fitted_dfine") / "w"
    shutil.copytree(prebuild.get("learns_dfine_prepared"), work)
    stage_cli("train", work, timeout=1800)
    stage_cli("evaluate", work)
    return work


for _name, _build in (("learns_prepared", _learns_prepared), ("fitted_workdir", _fitted_workdir),
                      ("learns_detr_prepared", _learns_detr_prepared), ("fitted_detr_workdir", _fitted_detr_workdir),
                      ("learns_dfine_prepared", _learns_dfine_prepared),
                      ("fitted_dfine_workdir", _fitted_dfine_workdir),
                      ("cached_workdir", _cached_workdir), ("trained_workdir", _trained_workdir),
                      ("two_rank_workdir", _two_rank_workdir), ("reproduced_repo", _reproduced_repo),
                      ("prefect_api", _prefect_api), ("s3_server", _s3_server)):
    prebuild.register(_name, _build, shared=_name not in ("prefect_api", "s3_server"))     # servers: per process
# Built in the background in this order when a selected test uses them: the order of first need in a full run
# (`RUN_LATE` included): trained_workdir (test_evaluate), reproduced_repo (test_export), learns_detr_prepared
# (test_train's RT-DETR kill -9 resume; it builds learns_prepared first, 2 short stages each), the learns trainings
# (test_learns, test_predict, test_serve), two_rank_workdir (test_cluster, test_distributed, test_elastic), prefect_api
# (test_cluster), killed_run (test_flows), workers_team (test_workers comes last); then any other registered build.
# The test modules register their own (test_flows' killed_run, test_workers' workers_team, test_learns' trainings on
# corrupted caches). The session fixtures the first test files need at once (cached_workdir, s3_server) are built
# by those tests, never queued.
PREBUILT = ("trained_workdir", "reproduced_repo", "learns_detr_prepared", "fitted_workdir", "learns[labels+1]",
            "learns[boxes*2]", "fitted_detr_workdir", "learns_detr[labels+1]", "fitted_dfine_workdir",
            "two_rank_workdir", "prefect_api",
            "killed_run", "workers_team")
BUILT_FIRST_BY_TESTS = ("cached_workdir", "s3_server")
# Modules run after the other tests of their level (tests/unit, tests/stages, tests/system: pyproject's testpaths),
# because their session fixtures are the longest background builds (three 150-iteration trainings, about 6 min of
# one core): in file order test_learns came 4 min into the run and waited for them with the other core idle.
# test_export_formats and test_serve use fitted_workdir too; test_transformers_e2e fitted_detr_workdir.
RUN_LATE = ("tests/stages/test_learns.py", "tests/stages/test_predict.py", "tests/stages/test_export_formats.py",
            "tests/stages/test_serve.py", "tests/stages/test_transformers_e2e.py")


# Under pytest-xdist (README: ``-n 2``) each test module is one unit of work, sent whole to one worker (its module
# fixtures are built once), except these, one unit together and sent first (the longest): they share the
# per-process Prefect server (`prefect_api`, and the local builds that use it) and the network-namespace test hosts
# at fixed 198.18.0.0/15 addresses, which two workers must not set up at once.
ONE_WORKER = ("tests/system/test_cluster.py", "tests/system/test_elastic.py", "tests/system/test_distributed.py",
              "tests/system/test_flows.py", "tests/system/test_workers.py")
ONE_WORKER_GROUP = "cluster_and_prefect"
# Under pytest-xdist, sent right after the `ONE_WORKER` unit (so to the other worker, at the start): the longest
# module outside it (the 8-trial search, ~6 min of one test). In level and file order it came among the last units
# of the run, where ~6 minutes of one test end the run while the other worker has nothing left to take.
RUN_EARLY = ("tests/system/test_search.py",)


def _unit(nodeid: str) -> str:
    """The xdist unit of work of test ``nodeid``: its module's path, or `ONE_WORKER_GROUP`."""
    path = nodeid.split("::")[0]
    return ONE_WORKER_GROUP if path in ONE_WORKER else path


@pytest.hookimpl(optionalhook=True)      # a hook of pytest-xdist: this conftest also loads without it
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler for ``-n N``: its module scheduling (``--dist loadfile``) with `_unit` as the unit, units
    sent in collection order. (``--dist loadgroup``'s ``xdist_group`` mark rewrites ``Item._nodeid``, which
    pytest 9 no longer reads: it would silently send every test alone.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(session, config, items):
    levels = config.getini("testpaths")
    xdist = hasattr(config, "workerinput")

    def key(item):
        path = item.nodeid.split("::")[0]
        level = next((n for n, top in enumerate(levels) if path.startswith(top + "/")), len(levels))
        return (xdist and path not in ONE_WORKER), (xdist and path not in RUN_EARLY), level, path in RUN_LATE

    items.sort(key=key)     # stable: file order otherwise


def pytest_collection_finish(session):
    worker = getattr(session.config, "workerinput", None)
    factory = session.config._tmp_path_factory                 # what the tmp_path_factory fixture returns
    prebuild.set_factory(factory, factory.getbasetemp().parent if worker else None)
    if os.environ.get("DETPIPE_TEST_PREBUILD", "1") == "0" or not session.items:
        return
    used = set().union(*(getattr(item, "fixturenames", ()) for item in session.items))
    builds = prebuild.registered()
    order = [n for n in (*PREBUILT, *builds) if n in builds and n not in BUILT_FIRST_BY_TESTS]
    order = list(dict.fromkeys(order))
    prebuild.schedule([name for name in order if builds[name] in used])
    if worker:      # the local builds (servers, runs on them): by the worker that gets the tests needing them
        for item in session.items:
            wanted = _LOCAL_BUILDS.setdefault(_unit(item.nodeid), [])
            wanted += [n for n in order if not prebuild.is_shared(n) and builds[n] in item.fixturenames
                       and n not in wanted]


# Under xdist: {unit: the local builds its tests use}, filled at the end of collection; a worker starts building a
# unit's before its first test (`prebuild.schedule_local`).
_LOCAL_BUILDS: dict[str, list[str]] = {}


def pytest_runtest_setup(item):
    names = _LOCAL_BUILDS.pop(_unit(item.nodeid), None)
    if names:
        prebuild.schedule_local(names)


def pytest_sessionfinish(session):
    prebuild.finish()


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def cached_workdir(tmp_path_factory) -> Path:
    """A working directory with ``params.yaml`` (tiny), ``data/raw`` (12 COCO128 images), and the real
    convert and augment stages' outputs ``data/arrow`` and ``data/cache``. Tests must not modify it."""
    return prebuild.get("cached_workdir")


@pytest.fixture(scope="session")
def trained_workdir(tmp_path_factory) -> Path:
    """A copy of `cached_workdir` after the real train stage (tiny params, 1 process)."""
    return prebuild.get("trained_workdir")


@pytest.fixture(scope="session")
def two_rank_workdir(tmp_path_factory) -> Path:
    """An uninterrupted single-node train run with 2 worker processes (world size 2) and ``ELASTIC_TRAIN``. Tests
    must not modify it. The run's stderr is ``two_rank_workdir.parent / TWO_RANK_LOG``."""
    return prebuild.get("two_rank_workdir")


@pytest.fixture(scope="session")
def reproduced_repo(tmp_path_factory) -> Path:
    """A git + DVC copy of the repository (`support.repos.make_repo` with ``REPRODUCED_PARAMS`` and the default
    export, torch.export included) after ``dvc repro`` of the whole pipeline, the run committed ("pipeline
    run"). Tests must not modify it: copy it with `support.repos.clone_with_cache`. The run's log (stdout and
    stderr as one stream) is ``reproduced_repo.parent / REPRODUCED_LOG``."""
    return prebuild.get("reproduced_repo")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Session-scoped SeaweedFS S3 server on 127.0.0.1 (`support.s3server.running_s3_server`, stopped at the end
    of the session): an `support.s3server.S3Server`."""
    return prebuild.get("s3_server")


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> Iterator:
    """One Prefect server for every Prefect test of the run (`support.prefect.prefect_server`: SQLite in a
    temporary ``PREFECT_HOME``, a free loopback port, the shortest safe heartbeat settings; stopped at the end of
    the session); its `support.prefect.Prefect`. Modules add their serve/worker processes to ``procs`` and stop
    them at their end."""
    return prebuild.get("prefect_api")


@pytest.fixture(scope="session")
def learns_prepared(tmp_path_factory) -> Path:
    """`support.pipeline.make_learns_workdir` (4 COCO128 images, 4 classes, train = val) after the real convert and
    augment stages' CLIs. Tests must not modify it."""
    return prebuild.get("learns_prepared")


@pytest.fixture(scope="session")
def fitted_workdir(tmp_path_factory) -> Path:
    """A copy of `learns_prepared` after the real train (150 iterations: the detector fits the 4 images, see
    tests/stages/test_learns.py) and evaluate stages: ``models/model.pt``, ``metrics/eval.json``. Tests must not modify
    it: copy it (a few MB)."""
    return prebuild.get("fitted_workdir")


@pytest.fixture(scope="session")
def learns_detr_prepared(tmp_path_factory) -> Path:
    """`learns_prepared` with `support.pipeline.LEARNS_DETR`'s params (rtdetr_v2_tiny), its cache rebuilt at 128 px
    by the real augment stage. Tests must not modify it."""
    return prebuild.get("learns_detr_prepared")


@pytest.fixture(scope="session")
def fitted_detr_workdir(tmp_path_factory) -> Path:
    """A copy of `learns_detr_prepared` after the real train (`support.pipeline.LEARNS_DETR_ITERATIONS` AdamW
    iterations: rtdetr_v2_tiny fits the 4 images, see tests/stages/test_learns.py) and evaluate stages. Tests must
    not modify it: copy it."""
    return prebuild.get("fitted_detr_workdir")


@pytest.fixture(scope="session")
def fitted_dfine_workdir(tmp_path_factory) -> Path:
    """`learns_prepared` with `support.pipeline.LEARNS_DFINE`'s params (dfine_tiny, 192 px) after the real augment,
    train and evaluate stages (see tests/stages/test_learns.py). Tests must not modify it."""
    return prebuild.get("fitted_dfine_workdir")
