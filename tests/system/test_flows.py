"""Prefect orchestration against a real Prefect server: deployment ``train/main`` served by ``python -m flows.serve``
runs the DVC pipeline in temporary git copies of the repository (12 COCO128 images, tiny params).

Fast tests check override handling and the deployment's parameter schema; the slow ones start
``prefect server start`` on a free loopback port with a temporary ``PREFECT_HOME`` (analytics off), serve the
deployment, trigger ``prefect deployment run train/main --watch`` and check the run, its outputs, the DVC
experiment, resume after a killed training, and two concurrent runs on one repository.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import psutil
import pytest

from support import prebuild
from support.pipeline import checkpoint_iterations
from support.prefect import ZOMBIE_AFTER_S, Prefect, run_id
from support.procs import REPO, run as sh, stage_env, stop_group
from support.repos import flow_repo, snapshot

import yaml

from detpipe import params as params_mod
from detpipe.orchestration.overrides import OverrideError
from detpipe.orchestration.overrides import apply as apply_overrides
from detpipe.orchestration.overrides import json_schema as overrides_schema
from detpipe.orchestration.overrides import normalize as normalize_overrides
from detpipe.orchestration.overrides import parse as parse_overrides

# ---------------------------------------------------------------------------------------------- fast tests


def test_overrides_keep_comments_and_are_validated(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copyfile(REPO / "params.yaml", params)
    before = params.read_text()
    overrides = normalize_overrides(parse_overrides(["train.lr=0.01", "train.milestones=[0.5, 0.8]"])
                                    | {"evaluate": {"batch_size": 2}})
    assert overrides == {"train.lr": 0.01, "train.milestones": [0.5, 0.8], "evaluate.batch_size": 2}
    assert apply_overrides(params, overrides) == before.encode()
    after = params.read_text()
    cfg = params_mod.load(path=params)
    assert (cfg.train.lr, cfg.train.milestones, cfg.evaluate.batch_size) == (0.01, [0.5, 0.8], 2)
    # only the overridden lines changed; comments and nulls elsewhere are as they were
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines()) and len(changed) == 3, changed
    assert all(a.split("#")[1:] == b.split("#")[1:] for a, b in changed), changed

    for bad, words in (({"train.lr": -1}, ["train.lr", "greater than 0"]),
                       ({"train.schedule": "sometimes"}, ["train.schedule", "cosine"])):
        with pytest.raises(OverrideError) as err:
            apply_overrides(params, normalize_overrides(bad))
        assert all(w in str(err.value) for w in words), err.value
        assert params.read_text() == after  # a rejected override leaves the file alone
    for bad in ({"train.lrr": 1}, {"lr": 1}, {"nosection.lr": 1}):
        with pytest.raises(OverrideError, match="not a params.yaml key"):
            normalize_overrides(bad)
    with pytest.raises(OverrideError, match="expected section.key=value"):
        parse_overrides(["train.lr"])


def schema_mismatch(params_yaml: dict, schema: dict) -> list[str]:
    """What the deployment's ``overrides`` schema gets wrong about a params.yaml read as plain YAML: keys of the
    file it lacks, keys it has that the file lacks, keys without a description, current values it rejects."""
    obj = schema["anyOf"][0]
    keys = {f"{s}.{k}" for s, section in params_yaml.items() for k in section}
    problems = [f"missing {k}" for k in sorted(keys - set(obj["properties"]))]
    problems += [f"extra {k}" for k in sorted(set(obj["properties"]) - keys)]
    problems += [f"undescribed {k}" for k, p in obj["properties"].items() if not p.get("description")]
    values = {k: params_yaml[k.split(".")[0]][k.split(".")[1]] for k in keys & set(obj["properties"])}
    problems += [f"rejects {e.path[0] if e.path else ''}: {e.message}"
                 for e in jsonschema.Draft202012Validator(schema).iter_errors(values)]
    return problems


def test_deployment_schema_covers_every_param():
    """The schema the deployment publishes matches params.yaml as the file has it (read as plain YAML, not
    through `Params`): every key, described, every current value accepted; a file with a key the schema
    lacks, or a schema missing a key, is caught."""
    schema = overrides_schema()
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    assert schema_mismatch(raw, schema) == []
    broken = copy.deepcopy(raw)
    broken["train"]["unknown_key"] = 1
    assert schema_mismatch(broken, schema) == ["missing train.unknown_key"]
    lacking = copy.deepcopy(schema)
    del lacking["anyOf"][0]["properties"]["train.lr"]
    assert "missing train.lr" in schema_mismatch(raw, lacking)
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate(None)
    assert not any("default" in p for p in schema["anyOf"][0]["properties"].values())
    for bad in ({"train.lr": -1}, {"train.lrr": 0.1}, {"train.schedule": "x"}, {"train.epochs": 1.5},
                {"download.sha256": "abc"}):
        assert not validator.is_valid(bad), bad


def test_heartbeat_and_crash_thresholds_are_settings(monkeypatch):
    """Crash detection's two intervals come from the environment (documented defaults 30 s / 90 s); a
    heartbeat below Prefect's minimum or a threshold that a live run's next heartbeat could miss is refused."""
    from detpipe.orchestration import deployments

    monkeypatch.delenv(deployments.HEARTBEAT_ENV, raising=False)
    monkeypatch.delenv(deployments.ZOMBIE_ENV, raising=False)
    assert (deployments.heartbeat_s(), deployments.zombie_after_s()) == (30, 90)
    monkeypatch.setenv(deployments.HEARTBEAT_ENV, "60")
    assert (deployments.heartbeat_s(), deployments.zombie_after_s()) == (60, 180)      # three heartbeats by default
    monkeypatch.setenv(deployments.ZOMBIE_ENV, "75")
    assert deployments.zombie_after_s() == 75
    for name, value, words in ((deployments.ZOMBIE_ENV, "60", "longer than the heartbeat interval (60 s)"),
                               (deployments.ZOMBIE_ENV, "1m", "whole seconds"),
                               (deployments.HEARTBEAT_ENV, "10", ">= 30 (Prefect's minimum)")):
        monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit, match=re.escape(words)):
            deployments.zombie_after_s()
        monkeypatch.setenv(name, {deployments.ZOMBIE_ENV: "75", deployments.HEARTBEAT_ENV: "60"}[name])


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def prefect(prefect_api):
    """The session's Prefect server with ``python -m flows.serve`` serving ``train/main`` (and ``sweep/main``)
    from this checkout; serve is stopped at the end of the module."""
    first = len(prefect_api.procs)
    prefect_api.serving("main")
    try:
        yield prefect_api
    finally:
        stop_group(prefect_api.procs[first:])
        del prefect_api.procs[first:]


def experiments(repo: Path) -> dict[str, dict]:
    """``dvc exp show --json``: {experiment name: {"params": params.yaml data, "metrics": {file: data}}}."""
    show = json.loads(sh([sys.executable, "-m", "dvc", "exp", "show", "--json"], repo).stdout)
    out = {}
    for commit in show:
        for exp in [e for x in commit.get("experiments") or [] for e in x.get("revs", [])]:
            data = exp.get("data") or {}
            out[exp.get("name")] = {
                "params": data.get("params", {}).get("params.yaml", {}).get("data", {}),
                "metrics": {f: m.get("data") for f, m in (data.get("metrics") or {}).items()},
                "outs": {f: o.get("hash") for f, o in (data.get("outs") or {}).items()}}
    return out


def _stage_segment(logs: str, stage: str) -> str:
    """The log lines of the last execution of ``stage``'s task in ``logs`` (from its ``$ ... dvc ... repro``
    line to the next command line the flow logged)."""
    lines = logs.splitlines()
    commands = [i for i, ln in enumerate(lines) if re.search(r" - \$ \S+ -m dvc ", ln)]
    starts = [i for i in commands if lines[i].endswith(f"repro --single-item {stage}")]
    assert starts, f"no {stage} task in the logs"
    end = next((i for i in commands if i > starts[-1]), len(lines))
    return "\n".join(lines[starts[-1]:end])


# ---------------------------------------------------------------------------------------------- slow tests
# Every run starts from a copy of the session's reproduced repository (`flow_repo`: its DVC cache holds the
# stages' outputs). `_killed_run` kills a run's training, then its serve process, and retries the Crashed run: it
# runs in the background early in the session (a minute of it is waiting for missed heartbeats); the cancel,
# sweep and watched runs use this module's own serve process (deployment train/main).

def _workspace(repo: Path, run: subprocess.Popen, timeout: float = 300) -> Path:
    """The isolated workspace the (only) run started on ``repo`` works in."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert run.poll() is None, run.stdout.read()[-4000:]
        found = [p for p in (repo / ".dvc/tmp/runs").glob("*") if (p / "dvc.yaml").is_file()]
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no workspace under {repo}/.dvc/tmp/runs within {timeout} s")


def _in(ws: Path) -> list[psutil.Process]:
    """Processes whose working directory is inside ``ws``."""
    found = []
    for p in psutil.process_iter(["cwd"]):
        with contextlib.suppress(psutil.Error, ValueError):
            if p.info["cwd"] and Path(p.info["cwd"]).is_relative_to(ws):
                found.append(p)
    return found


def _train_launcher(ws: Path) -> psutil.Process | None:
    """The ``python -m stages.train`` process DVC started in ``ws`` (not its torchrun workers)."""
    found = []
    for p in _in(ws):
        with contextlib.suppress(psutil.Error):
            cmd = p.cmdline()
            if "stages.train" in cmd and "-m" in cmd:
                found.append(p)
    pids = {p.pid for p in found}
    roots = [p for p in found if p.ppid() not in pids]
    return roots[0] if roots else None


def _wait_checkpoint(ws: Path, after: int, run: subprocess.Popen, timeout: float = 300) -> int:
    """Wait until a checkpoint of an iteration > ``after`` exists and the train stage is running; return the
    newest checkpoint's iteration."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert run.poll() is None, run.stdout.read()[-4000:]
        ckpts = checkpoint_iterations(ws)
        if ckpts and ckpts[-1] > after and _train_launcher(ws) is not None:
            return ckpts[-1]
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint after iteration {after} within {timeout} s")


def _run_tree(ws: Path) -> list[psutil.Process]:
    """The flow-run process working on ``ws`` and every process below it (guard, DVC, stage, torchrun)."""
    flow_proc = next(p.parent() for p in _in(ws) if p.parent() and not _in_ws(p.parent(), ws))
    return [flow_proc, *flow_proc.children(recursive=True)]


def _in_ws(p: psutil.Process, ws: Path) -> bool:
    with contextlib.suppress(psutil.Error, ValueError):
        return Path(p.cwd()).is_relative_to(ws) or "runs.py" in " ".join(p.cmdline())
    return False


def _still_alive(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``procs`` still running (zombies count as gone) after waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


CRASH = "crash"   # the killed run's deployment (train/crash), served by its own serve processes


def _killed_run(factory) -> dict:
    """A run of ``train/crash`` with overrides on a fresh repository copy: its train stage is killed (SIGKILL)
    after a checkpoint, which the task's retry resumes; in that retry, after another checkpoint, its
    ``flows.serve`` process is killed (SIGKILL) and a new one started. The run must die with it and be marked
    Crashed by the server; ``prefect flow-run retry`` then completes it on the new serve process. Built once per
    session in the background while other tests run (`support.prebuild`: its minute of waiting for missed
    heartbeats costs nothing); its serve processes (their own deployment, so no other test's run lands on them)
    are stopped before it returns."""
    api = prebuild.get("prefect_api")
    prefect = Prefect(dict(api.env), api.logs)          # the session's server, this build's own processes
    try:
        prefect.serving(CRASH)
        repo = flow_repo(prebuild.get("reproduced_repo"), factory.mktemp("flow") / "repo",
                         train={"epochs": 4, "checkpoint_every": 1})
        before = snapshot(repo)
        overrides = {"train.lr": 0.02, "flows.retries": 1, "flows.retry_delay_s": 1}
        run = prefect.start_run(repo, overrides, "killed-run", deployment=f"train/{CRASH}")
        ws = _workspace(repo, run)
        # the workspace starts with the reproduced run's checkpoints (a `persist: true` output, checked out): wait
        # for one of this run's training, past them
        first = _wait_checkpoint(ws, max(checkpoint_iterations(repo), default=0), run)
        launcher = _train_launcher(ws)
        tree = [launcher, *launcher.children(recursive=True)]
        launcher.kill()
        psutil.wait_procs(tree, timeout=30)
        first = checkpoint_iterations(ws)[-1]
        _wait_checkpoint(ws, first, run)  # in the train task's retry
        # the flow process dies with serve: first let it ship (batched every 0.5 s) the retry's log line that
        # test_killed_serve_crashes_run_and_retry_resumes reads from the server - wait for that very line there
        resumed, flow_run = f"resuming from checkpoints/ckpt-{first:07d}.pt", prefect.id_of("killed-run")
        deadline = time.monotonic() + 60
        while resumed not in prefect.logs_of(flow_run):
            assert run.poll() is None, run.stdout.read()[-4000:]
            assert time.monotonic() < deadline, f"no {resumed!r} in the run's log on the server after 60 s"
            time.sleep(0.5)
        tree = _run_tree(ws)
        prefect.procs[-1].kill()                         # the serve process running the flow
        killed_at = time.monotonic()
        left = _still_alive(tree, timeout=30)
        left_in_ws = _in(ws)
        second = checkpoint_iterations(ws)[-1]
        prefect.serving(CRASH)                           # the retry's serve process
        text = run.communicate(timeout=ZOMBIE_AFTER_S + 300)[0]
        crashed_after = time.monotonic() - killed_at
        run_uuid = run_id(text)
        crashed = {"rc": run.returncode, "out": text, "after_s": crashed_after, "left": left,
                   "logs": prefect.logs_of(run_uuid), "left_in_ws": left_in_ws, "tree": len(tree),
                   "state": prefect.flow_run(run_uuid)["state"]["type"],
                   "workspace_kept": (ws / "checkpoints").is_dir()}
        prefect.cli("flow-run", "retry", run_uuid)
        final = prefect.wait_final(run_uuid)
        return {"repo": repo, "ws": ws, "id": run_uuid, "first": first, "second": second, "crashed": crashed,
                "final": final, "logs": prefect.logs_of(run_uuid), "before": before, "after": snapshot(repo)}
    finally:
        stop_group(prefect.procs)


prebuild.register("killed_run", _killed_run, shared=False)    # runs on this process's Prefect server


@pytest.fixture(scope="module")
def killed_run(prefect_api, reproduced_repo):
    """`_killed_run`'s outcome (built in the background, or here if it has not started)."""
    return prebuild.get("killed_run")


def readme_exp_show() -> list[str]:
    """The README's command for comparing experiments in 80 columns (its ``dvc exp show --only-changed ... --drop
    ...`` line), as argv."""
    import shlex

    lines = (REPO / "README.md").read_text().splitlines()
    line = next(ln for ln in lines if ln.startswith("dvc exp show --only-changed ") and " --drop " in ln)
    return [sys.executable, "-m", *shlex.split(line)]


def fits_80_columns(table: str) -> bool:
    """No line wider than 80 characters and no column collapsed to an ellipsis."""
    return bool(table.strip()) and max(len(ln) for ln in table.splitlines()) <= 80 and "…" not in table


def _columns80(cmd: list[str], cwd: Path) -> str:
    """Output of ``cmd`` run as in an 80-column terminal (``COLUMNS=80``)."""
    proc = subprocess.run(cmd, cwd=cwd, env={**stage_env(), "COLUMNS": "80", "DVC_NO_ANALYTICS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_cancel_stops_training_and_leaves_workspace_as_it_was(prefect, reproduced_repo, tmp_path):
    """``prefect flow-run cancel`` during training: the run ends Cancelled, every process of the run is gone
    within 30 s, DVC leaves no lock, and the user's workspace is byte-identical to before the run."""
    repo = flow_repo(reproduced_repo, tmp_path / "repo")
    before = snapshot(repo)
    run = prefect.start_run(repo, {"train.epochs": 50, "train.checkpoint_every": 1}, "cancelled-run")
    ws = _workspace(repo, run)
    _wait_checkpoint(ws, max(checkpoint_iterations(repo), default=0), run)   # past the checked-out ones
    tree = _run_tree(ws)
    out_id = prefect.id_of("cancelled-run")
    prefect.cli("flow-run", "cancel", out_id)
    cancelled_at = time.monotonic()
    left = _still_alive(tree, timeout=30)
    gone_after = time.monotonic() - cancelled_at
    final = prefect.wait_final(out_id, timeout=120)
    run.communicate(timeout=120)
    assert final["state"]["type"] == "CANCELLED", final["state"]
    assert len(tree) >= 4 and left == [] and _in(ws) == [], (left, gone_after)
    # DVC was interrupted as by Ctrl-C: it ended through its own error path (which releases its lock)
    train_log = _stage_segment(prefect.logs_of(out_id), "train")
    assert re.search(r"ERROR: (failed to reproduce 'train'|interrupted by the user)", train_log), train_log[-3000:]
    assert not ws.exists() and sh(["git", "worktree", "list"], repo).stdout.count("\n") == 1
    assert snapshot(repo) == before
    sh([sys.executable, "-m", "dvc", "status"], repo)  # DVC is usable in the user's workspace


@pytest.mark.slow
def test_sweep_runs_in_parallel_and_compares_in_80_columns(prefect, reproduced_repo, tmp_path):
    """``sweep/main`` with a grid of 2 learning rates (``flows.max_parallel: 2``): the shared stages run once
    before, both experiments' train stages overlap in time (log timestamps) and each continues the committed 1-epoch
    run's checkpoint with 2 epochs and its lr (only iterations 2..4 train), both are DVC experiments with their
    params, the README's ``dvc exp show`` command shows their AP, AP50 and train.lr in 80 columns without an
    ellipsis, and the user's workspace is unchanged.

    Meanwhile (the server runs two deployment runs at once), ``sweep/main`` with a ``search`` (issue 48 item 2) on
    a second copy of the repository: a one-trial Optuna search through the deployment, whose trial ``dep-t0`` is a
    DVC experiment with the drawn lr and is COMPLETE in the run's ``search-results`` artifact."""
    repo = flow_repo(reproduced_repo, tmp_path / "repo")
    apply_overrides(repo / "params.yaml", {"flows.max_parallel": 2, "train.epochs": 2})   # 4 iterations each
    sh(["git", "commit", "-qam", "two experiments at once"], repo)
    before = snapshot(repo)
    search_repo = flow_repo(reproduced_repo, tmp_path / "search-repo", train={"epochs": 2})
    search = {"repo": str(search_repo), "search": {"study": "dep", "n_trials": 1, "pruner": "none",
                                                   "space": {"train.lr": "choice 0.02 0.025"}}}
    searching = subprocess.Popen([sys.executable, "-m", "prefect", "deployment", "run", "sweep/main", "--params",
                                  json.dumps(search), "--flow-run-name", "search1", "--watch", "--watch-interval",
                                  "2"], env=prefect.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 cwd=prefect.logs)
    params = {"grid": {"train.lr": [0.03, 0.04]}, "repo": str(repo)}
    proc = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "sweep/main", "--params",
                           json.dumps(params), "--flow-run-name", "sweep1", "--watch", "--watch-interval", "2"],
                          env=prefect.env, capture_output=True, text=True, timeout=1200, cwd=prefect.logs)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    shared = prefect.logs_of(prefect.id_of("sweep1-shared"))
    assert "train" not in re.findall(r"repro --single-item (\w+)", shared), shared[-3000:]
    spans = {}
    for name in ("sweep1-0", "sweep1-1"):
        logs = prefect.logs_of(prefect.id_of(name))
        for stage in ("download", "convert", "augment"):
            assert f"Running stage '{stage}'" not in _stage_segment(logs, stage), (name, stage)
        train_log = _stage_segment(logs, "train")
        assert "Running stage 'train'" in train_log, train_log[-3000:]
        # the committed 1-epoch run's checkpoint is continued with the run's schedule (issue 35), not retrained
        lr = {"sweep1-0": 0.03, "sweep1-1": 0.04}[name]
        assert re.search(rf"continuing the training of checkpoint iteration 2 with another schedule \(epochs 1 -> 2, "
                         rf"lr [0-9.e-]+ -> {lr}\)", train_log), train_log[-3000:]
        assert "iterations 2..4" in train_log, train_log[-3000:]
        stamps = [m.group(0) for m in re.finditer(r"\b\d{2}:\d{2}:\d{2}\.\d+", train_log)]
        spans[name] = (stamps[0], stamps[-1])
    (a0, a1), (b0, b1) = spans.values()
    assert a0 < b1 and b0 < a1, spans  # the two train stages overlap
    exps = experiments(repo)
    for name, lr in (("sweep1-0", 0.03), ("sweep1-1", 0.04)):
        assert exps[name]["params"]["train"]["lr"] == lr and exps[name]["metrics"]["metrics/eval.json"]["bbox"]
    assert snapshot(repo) == before

    table = _columns80(readme_exp_show(), repo)
    lines = table.splitlines()
    assert fits_80_columns(table), table
    header = next(ln for ln in lines if "Experiment" in ln)
    assert re.search(r"\bAP\b", header) and "AP50" in header and "train.lr" in header, table
    for name, lr in (("sweep1-0", "0.03"), ("sweep1-1", "0.04")):
        row = next(ln for ln in lines if f"[{name}]" in ln)
        assert lr in row, table
    # the check catches a table that does not fit: the same command without its --drop
    wide = _columns80(readme_exp_show()[:readme_exp_show().index("--drop")], repo)
    assert not fits_80_columns(wide), wide

    # the search through the deployment
    out, _ = searching.communicate(timeout=1200)
    assert searching.returncode == 0, out[-4000:]
    rows = json.loads(prefect.artifact(prefect.id_of("search1-search"), "search-results"))   # the search subflow
    assert [(r["trial"], r["experiment"], r["state"]) for r in rows] == [(0, "dep-t0", "COMPLETE")], rows
    lr = json.loads(rows[0]["train.lr"])
    found = experiments(search_repo)
    assert set(found) == {"dep-t0"} and found["dep-t0"]["params"]["train"]["lr"] == lr and lr in (0.02, 0.025)
    assert found["dep-t0"]["metrics"]["metrics/eval.json"]["bbox"]["AP50"] == pytest.approx(rows[0]["AP50"])


@pytest.mark.slow
def test_killed_serve_crashes_run_and_retry_resumes(killed_run):
    """The killed train task's retry resumes from its checkpoint; killing serve kills every process of the run
    within 30 s and the server marks it Crashed within the documented bound; ``prefect flow-run retry``
    continues in the kept workspace, skips the finished stages, resumes training and completes; the user's
    workspace never changed and the run's workspace is gone."""
    crashed, logs = killed_run["crashed"], killed_run["logs"]
    assert f"resuming from checkpoints/ckpt-{killed_run['first']:07d}.pt" in crashed["logs"], crashed["logs"][-6000:]
    assert crashed["tree"] >= 4 and crashed["left"] == [] and crashed["left_in_ws"] == [], crashed
    assert crashed["state"] == "CRASHED" and crashed["rc"] != 0 and "Crashed" in crashed["out"], crashed["out"][-3000:]
    print(f"run Crashed {crashed['after_s']:.0f} s after its serve process was killed")
    assert crashed["after_s"] < ZOMBIE_AFTER_S + 5 + 25, crashed["after_s"]  # documented bound + a loaded machine
    assert crashed["workspace_kept"]

    assert killed_run["final"]["state"]["type"] == "COMPLETED", logs[-6000:]
    assert f"continuing in the workspace an earlier attempt of this run kept: {killed_run['ws']}" in logs
    for stage in ("download", "convert", "augment"):
        assert f"Stage '{stage}' didn't change, skipping" in _stage_segment(logs, stage), stage
    train_log = _stage_segment(logs, "train")
    assert f"resuming from checkpoints/ckpt-{killed_run['second']:07d}.pt" in train_log, train_log[-4000:]
    assert "starting fresh" not in train_log
    assert killed_run["after"] == killed_run["before"]
    assert not killed_run["ws"].exists()
    assert sh(["git", "worktree", "list"], killed_run["repo"]).stdout.count("\n") == 1


@pytest.mark.slow
def test_run_outputs_result_and_experiment(prefect, killed_run):
    """The completed run is a DVC experiment with its overrides, metrics and outputs; the result and artifact
    name the experiment and its outputs' files in the shared DVC cache."""
    repo, run = killed_run["repo"], killed_run["id"]
    exp = experiments(repo)["killed-run"]
    assert exp["params"]["train"]["lr"] == 0.02 and exp["params"]["flows"]["retries"] == 1
    assert exp["params"]["train"]["epochs"] == 4  # committed, not overridden
    eval_metrics = exp["metrics"]["metrics/eval.json"]
    assert len(eval_metrics["bbox"]) == 12
    assert exp["metrics"]["dvclive/metrics.json"]  # untracked `cache: false` metrics are in the experiment

    result = prefect.result(run)
    assert result["experiment"] == "killed-run" and result["ref"].endswith("/killed-run")
    assert sh(["git", "show-ref", result["ref"]], repo).stdout.strip()  # the experiment's real git ref
    assert result["overrides"]["train.lr"] == 0.02 and result["metrics"] == eval_metrics["bbox"]
    assert list(result["stages"]) == ["download", "convert", "augment", "train", "evaluate", "export"]
    assert result["stages"]["download"] == "skipped" and result["stages"]["train"] == "ran"
    for rel in ("models/model.pt", "models/torch_export", "models/model.onnx", "data/cache"):
        out = result["outputs"][rel]
        assert out["md5"] == exp["outs"][rel] and Path(out["cache"]).is_file(), (rel, out, exp["outs"])
    artifact = prefect.artifact(run, "train-results")
    assert "killed-run" in artifact and result["outputs"]["models/model.onnx"]["md5"] in artifact
    assert "COCOeval" in _stage_segment(killed_run["logs"], "evaluate")  # stage output is in the run log


@pytest.mark.slow
def test_watched_run_and_bad_overrides(prefect, killed_run, tmp_path):
    """After ``dvc exp apply`` of a run, a watched run with the same params skips every stage (its workspace
    starts from the user's dvc.lock and the shared cache) and exits 0; the server refuses unknown keys and bad
    values up front."""
    repo = tmp_path / "repo"
    shutil.copytree(killed_run["repo"], repo, symlinks=True)
    sh([sys.executable, "-m", "dvc", "exp", "apply", "killed-run"], repo)
    rc, out, run = prefect.run(repo, {"train.lr": 0.02, "flows.retry_delay_s": 3}, "watched-run")
    assert rc == 0 and "Completed" in out, out[-4000:]
    # nothing runs: each stage is up to date ("skipped") or checked out of DVC's run-cache ("restored")
    assert set(prefect.result(run)["stages"].values()) <= {"skipped", "restored"}, prefect.logs_of(run)[-4000:]
    assert "Running stage" not in prefect.logs_of(run)
    exps = experiments(repo)
    assert exps["watched-run"]["params"]["train"]["lr"] == 0.02
    assert exps["watched-run"]["params"]["flows"]["retry_delay_s"] == 3
    assert exps["watched-run"]["metrics"]["metrics/eval.json"] == exps["killed-run"]["metrics"]["metrics/eval.json"]
    for bad, word in (({"train.lrr": 0.1}, "train.lrr"), ({"train.lr": -1}, "train.lr")):
        proc = prefect.cli("deployment", "run", "train/main", "--params", json.dumps({"overrides": bad}), check=False)
        assert proc.returncode != 0 and word in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.slow
def test_run_warm_starts_from_an_experiment_and_stops_early(prefect, killed_run, tmp_path):
    """A run with overrides naming another experiment's model (``train.weights: exp:killed-run`` and its sha256,
    issue 35) and early stopping (val AP evaluated every iteration can never gain ``min_delta`` 1, so the second
    evaluation is the ``patience`` 1'th stale one): the launcher copies that model after checking the pin, training
    stops at iteration 2 of 8 on its own, and the experiment shows its source and its stop in `dvc exp show`."""
    import dvc.api

    repo = tmp_path / "repo"
    shutil.copytree(killed_run["repo"], repo, symlinks=True)
    with dvc.api.open("models/model.pt", repo=str(repo), rev="killed-run", mode="rb") as f:
        pinned = hashlib.sha256(f.read()).hexdigest()
    overrides = {"train.weights": "exp:killed-run", "train.weights_sha256": pinned, "train.eval_every": 1,
                 "train.patience": 1, "train.min_delta": 1.0}
    rc, out, run = prefect.run(repo, overrides, "warm-early")
    train_log = _stage_segment(prefect.logs_of(run), "train")
    assert rc == 0 and "Completed" in out, train_log[-4000:] + out[-2000:]
    assert f"train.weights exp:killed-run (sha256 {pinned}) copied to checkpoints/warm_start.pt" in train_log
    assert "iterations 0..8" in train_log and "stopped early at iteration 2:" in train_log, train_log[-4000:]
    exp = experiments(repo)["warm-early"]
    assert exp["params"]["train"]["weights"] == "exp:killed-run" and exp["params"]["train"]["patience"] == 1
    assert exp["metrics"]["dvclive/metrics.json"]["train"]["stopped_early_at"] == 2, exp["metrics"]
