"""Prefect orchestration against a real Prefect server: deployment ``train/main`` served by ``python -m flows.serve``
runs the DVC pipeline in temporary git copies of the repository (12 COCO128 images, tiny params).

Fast tests check override handling and the deployment's parameter schema; the slow ones start
``prefect server start`` on a free loopback port with a temporary ``PREFECT_HOME`` (analytics off), serve the
deployment, trigger ``prefect deployment run train/main --watch`` and check the run, its outputs, the DVC
experiment, resume after a killed training, and two concurrent runs on one repository.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jsonschema
import psutil
import pytest

from conftest import REPO, stage_env, write_params
from test_pipeline import copy_repo, sh

from flows.serve import overrides_schema
from flows.train import FlowError, apply_overrides, normalize_overrides, parse_overrides
from detpipe import params as params_mod
from detpipe.io import folder_sha256

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
        with pytest.raises(FlowError) as err:
            apply_overrides(params, normalize_overrides(bad))
        assert all(w in str(err.value) for w in words), err.value
        assert params.read_text() == after  # a rejected override leaves the file alone
    for bad in ({"train.lrr": 1}, {"lr": 1}, {"nosection.lr": 1}):
        with pytest.raises(FlowError, match="not a params.yaml key"):
            normalize_overrides(bad)
    with pytest.raises(FlowError, match="expected section.key=value"):
        parse_overrides(["train.lr"])


def test_deployment_schema_covers_every_param():
    schema = overrides_schema()
    obj = schema["anyOf"][0]
    full = params_mod.load()  # the repository's params.yaml
    keys = {f"{s}.{k}" for s, section in full.model_dump().items() for k in section}
    assert set(obj["properties"]) == keys
    validator = jsonschema.Draft202012Validator(schema)
    # every current value is accepted; the schema carries no defaults (params.yaml holds them)
    validator.validate({k: getattr(getattr(full, k.split(".")[0]), k.split(".")[1]) for k in keys})
    validator.validate(None)
    assert not any("default" in p for p in obj["properties"].values())
    for bad in ({"train.lr": -1}, {"train.lrr": 0.1}, {"train.schedule": "x"}, {"train.epochs": 1.5},
                {"download.sha256": "abc"}):
        assert not validator.is_valid(bad), bad


# ---------------------------------------------------------------------------------------------- server fixtures

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Prefect:
    """A running Prefect server + ``python -m flows.serve``, and CLI helpers bound to them."""

    def __init__(self, env: dict, logs: Path):
        self.env, self.logs = env, logs

    def cli(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "prefect", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, cwd=self.logs)
        if check:
            assert proc.returncode == 0, f"prefect {' '.join(args)}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def run_args(self, repo: Path, overrides: dict | None, name: str) -> list[str]:
        params = {"repo": str(repo), "overrides": overrides}
        return [sys.executable, "-m", "prefect", "deployment", "run", "train/main", "--params", json.dumps(params),
                "--flow-run-name", name, "--watch", "--watch-interval", "2"]

    def start_run(self, repo: Path, overrides: dict | None, name: str) -> subprocess.Popen:
        return subprocess.Popen(self.run_args(repo, overrides, name), env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=self.logs)

    def run(self, repo: Path, overrides: dict | None, name: str, timeout: float = 600) -> tuple[int, str, str]:
        """``prefect deployment run train/main --watch``: (exit status, output, flow run id)."""
        proc = subprocess.run(self.run_args(repo, overrides, name), env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.logs)
        return proc.returncode, proc.stdout + proc.stderr, run_id(proc.stdout + proc.stderr)

    def flow_run(self, run: str) -> dict:
        return json.loads(self.cli("flow-run", "inspect", run, "-o", "json").stdout)

    def wait_final(self, run: str, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.flow_run(run)
            if info["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return info
            time.sleep(2)
        raise AssertionError(f"flow run {run} still {info['state']['type']} after {timeout} s")

    def logs_of(self, run: str) -> str:
        return self.cli("flow-run", "logs", run).stdout

    def result(self, run: str) -> dict:
        """The flow run's persisted return value (read back through the API and result storage)."""
        code = ("import json, sys\nfrom prefect.client.orchestration import get_client\n"
                "with get_client(sync_client=True) as c:\n"
                "    print(json.dumps(c.read_flow_run(sys.argv[1]).state.result()))\n")
        proc = subprocess.run([sys.executable, "-c", code, run], env=self.env, capture_output=True, text=True,
                              timeout=120, cwd=self.logs)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])


def run_id(output: str) -> str:
    m = re.search(r"flow-run/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})", output)
    assert m, output
    return m.group(1)


@pytest.fixture(scope="module")
def prefect(tmp_path_factory):
    """``prefect server start --host 127.0.0.1`` on a free port (SQLite in a temporary PREFECT_HOME, analytics
    off) and ``python -m flows.serve`` serving ``train/main``; both stopped at the end."""
    home = tmp_path_factory.mktemp("prefect_home")
    port = _free_port()
    env = {**stage_env(), "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "PREFECT_SERVER_UI_ENABLED": "false", "PREFECT_CLI_WRAP_LINES": "false",
           "PREFECT_RUNNER_POLL_FREQUENCY": "2",  # serve picks new runs up within 2 s
           "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    procs = []
    try:
        with open(home / "server.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                           "--port", str(port)], env=env, cwd=home, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert procs[0].poll() is None, (home / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prefect server did not become healthy in 180 s"
            time.sleep(0.5)
        with open(home / "serve.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "flows.serve"], env=env, cwd=REPO, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        p = Prefect(env, home)
        deadline = time.monotonic() + 120
        while p.cli("deployment", "inspect", "train/main", check=False).returncode != 0:
            assert procs[1].poll() is None, (home / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "deployment train/main not served in 120 s"
            time.sleep(1)
        yield p
    finally:
        for proc in reversed(procs):
            _stop(proc)


def make_repo(dest: Path, train: dict | None = None) -> Path:
    """A git copy of the repository with 12 images and tiny params (committed), pinned by the subset's sha256."""
    work = copy_repo(dest)
    write_params(work, {"download": {"sha256": folder_sha256(work / "data" / "coco128")}, "train": train or {}})
    sh(["git", "commit", "-qam", "tiny params"], work)
    return work


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
# One pipeline is built per module (the export stage alone takes about a minute on 2 cores): `killed_run`
# builds it through a run whose training is killed twice and which is then retried; the other tests copy it.

def _train_launcher(repo: Path) -> psutil.Process | None:
    """The ``python -m stages.train`` process DVC started in ``repo`` (not its torchrun workers)."""
    found = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        try:
            cmd = p.info["cmdline"] or []
            if p.info["cwd"] == str(repo) and "stages.train" in cmd and "-m" in cmd:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    pids = {p.pid for p in found}
    roots = [p for p in found if p.ppid() not in pids]
    return roots[0] if roots else None


def _checkpoints(repo: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in (repo / "checkpoints").glob("ckpt-*.pt"))


def _wait_checkpoint(repo: Path, after: int, run: subprocess.Popen, timeout: float = 300) -> int:
    """Wait until a checkpoint of an iteration > ``after`` exists and the train stage is running; return the
    newest checkpoint's iteration."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert run.poll() is None, run.stdout.read()[-4000:]
        ckpts = _checkpoints(repo) if (repo / "checkpoints").is_dir() else []
        if ckpts and ckpts[-1] > after and _train_launcher(repo) is not None:
            return ckpts[-1]
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint after iteration {after} within {timeout} s")


def _kill_after_checkpoint(repo: Path, after: int, run: subprocess.Popen) -> int:
    """`_wait_checkpoint`, then SIGKILL the train stage's launcher (its torchrun workers die with it); return
    the newest checkpoint's iteration."""
    _wait_checkpoint(repo, after, run)
    proc = _train_launcher(repo)
    workers = proc.children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    psutil.wait_procs([proc, *workers], timeout=30)
    return _checkpoints(repo)[-1]


def _flow_process(repo: Path) -> psutil.Process:
    """The flow run's process: the parent of the ``dvc repro`` it runs in ``repo``."""
    for p in psutil.process_iter(["cmdline", "cwd"]):
        with contextlib.suppress(psutil.Error):
            cmd = p.info["cmdline"] or []
            if p.info["cwd"] == str(repo) and "dvc" in cmd and "repro" in cmd:
                return p.parent()
    raise AssertionError(f"no dvc repro running in {repo}")


@pytest.fixture(scope="module")
def killed_run(prefect, tmp_path_factory):
    """A deployment run with overrides on a fresh repository copy whose training is killed twice, each time
    after a checkpoint: first the train stage (SIGKILL), which the task's retry resumes; then, in that retry,
    the flow run's own process (SIGKILL) while the train stage is stopped (SIGSTOP), leaving it behind as a
    killed runner or machine would. The run crashes; ``prefect flow-run retry`` then completes it."""
    repo = make_repo(tmp_path_factory.mktemp("flow") / "repo", train={"epochs": 4, "checkpoint_every": 1})
    params_before = (repo / "params.yaml").read_text()
    overrides = {"train.lr": 0.02, "flows.retries": 1, "flows.retry_delay_s": 1}
    run = prefect.start_run(repo, overrides, "killed-run")
    left = []
    try:
        first = _kill_after_checkpoint(repo, 0, run)
        second = _wait_checkpoint(repo, first, run)  # in the train task's retry
        launcher = _train_launcher(repo)
        left = [launcher, *launcher.children(recursive=True)]
        for p in left:
            p.suspend()
        second = _checkpoints(repo)[-1]
        time.sleep(3)  # let the flow process ship the logs it has (batched every 0.5 s) before it dies
        flow_proc = _flow_process(repo)
        flow_proc.kill()
        psutil.wait_procs([flow_proc], timeout=30)
        out = run.communicate(timeout=300)[0]
        run_uuid = run_id(out)
        crashed = {"rc": run.returncode, "out": out, "logs": prefect.logs_of(run_uuid),
                   "params_after": (repo / "params.yaml").read_text(), "model": (repo / "models/model.pt").exists(),
                   "backup": (repo / ".dvc/tmp/flows/params.yaml.orig").exists(),
                   "left_alive": all(p.is_running() for p in left)}
        prefect.cli("flow-run", "retry", run_uuid)
        final = prefect.wait_final(run_uuid)
        gone = [not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in left]
    finally:
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
    return {"repo": repo, "id": run_uuid, "first": first, "second": second, "crashed": crashed, "final": final,
            "gone": gone, "logs": prefect.logs_of(run_uuid), "params_before": params_before}


@pytest.mark.slow
def test_killed_training_resumes(killed_run):
    """The killed train task's retry resumes from the checkpoint; after the flow process itself is killed,
    ``prefect flow-run retry`` kills the stage it left behind, puts params.yaml back, skips the finished stages
    and resumes training again."""
    crashed, logs = killed_run["crashed"], killed_run["logs"]
    assert crashed["rc"] != 0 and "Crashed" in crashed["out"], crashed["out"][-3000:]
    assert f"resuming from checkpoints/ckpt-{killed_run['first']:07d}.pt" in crashed["logs"], crashed["logs"][-6000:]
    assert crashed["backup"] and crashed["params_after"] != killed_run["params_before"] and crashed["left_alive"]
    assert not crashed["model"]

    assert killed_run["final"]["state"]["type"] == "COMPLETED", logs[-6000:]
    killed = re.search(r"killed (\d+) leftover process\(es\)", logs)
    # the stopped train stage and its torchrun workers were killed (and whatever else was left in its session)
    assert killed and int(killed.group(1)) >= len(killed_run["gone"]) and all(killed_run["gone"]), logs[-6000:]
    assert "left params.yaml overridden; restoring it" in logs
    for stage in ("download", "convert", "augment"):
        assert f"Stage '{stage}' didn't change, skipping" in _stage_segment(logs, stage), stage
    train_log = _stage_segment(logs, "train")
    assert f"resuming from checkpoints/ckpt-{killed_run['second']:07d}.pt" in train_log, train_log[-4000:]
    assert "starting fresh" not in train_log
    repo = killed_run["repo"]
    assert _checkpoints(repo)[-1] == 8  # 4 epochs x 2 iterations (9 train images, batch 4)
    assert (repo / "params.yaml").read_text() == killed_run["params_before"]
    assert not (repo / ".dvc/tmp/flows/params.yaml.orig").exists()


@pytest.mark.slow
def test_run_outputs_result_and_experiment(prefect, killed_run):
    """The completed run's outputs exist, its result and artifact point at them, and it is a DVC experiment
    with its overrides and metrics."""
    repo, run = killed_run["repo"], killed_run["id"]
    for rel in ("data/raw/annotations/instances_train2017.json", "data/arrow/meta.json", "data/cache/meta.json",
                "models/model.pt", "models/torch_export/model.pt2", "models/model.onnx", "models/export_report.json",
                "metrics/eval.json", "dvclive/metrics.json"):
        assert (repo / rel).is_file(), rel
    exp = experiments(repo)["killed-run"]
    assert exp["params"]["train"]["lr"] == 0.02 and exp["params"]["flows"]["retries"] == 1
    assert exp["params"]["train"]["epochs"] == 4  # committed, not overridden
    eval_metrics = exp["metrics"]["metrics/eval.json"]
    assert eval_metrics == json.loads((repo / "metrics/eval.json").read_text()) and len(eval_metrics["bbox"]) == 12
    assert exp["metrics"]["dvclive/metrics.json"]  # untracked `cache: false` metrics are in the experiment

    result = prefect.result(run)
    assert result["experiment"] == "killed-run" and result["overrides"]["train.lr"] == 0.02
    assert list(result["stages"]) == ["download", "convert", "augment", "train", "evaluate", "export"]
    assert result["stages"]["download"] == "skipped" and result["stages"]["train"] == "ran"
    assert result["paths"]["metrics"] == str(repo / "metrics/eval.json")
    assert result["paths"]["onnx"] == str(repo / "models/model.onnx") and result["metrics"] == eval_metrics["bbox"]
    assert str(repo / "models/model.onnx") in prefect.cli("artifact", "inspect", "train-results").stdout
    assert "COCOeval" in _stage_segment(killed_run["logs"], "evaluate")  # stage output is in the run log


@pytest.mark.slow
def test_watched_run_and_bad_overrides(prefect, killed_run, tmp_path):
    """``prefect deployment run train/main --watch`` exits 0 once the run completed; DVC skips every stage
    whose params the overrides leave alone; the server refuses unknown keys and bad values up front."""
    repo = tmp_path / "repo"
    shutil.copytree(killed_run["repo"], repo, symlinks=True)
    rc, out, run = prefect.run(repo, {"train.lr": 0.02, "flows.retry_delay_s": 3}, "watched-run")
    assert rc == 0 and "Completed" in out, out[-4000:]
    assert set(prefect.result(run)["stages"].values()) == {"skipped"}
    exp = experiments(repo)["watched-run"]
    assert exp["params"]["train"]["lr"] == 0.02 and exp["params"]["flows"]["retry_delay_s"] == 3
    assert exp["metrics"]["metrics/eval.json"] == experiments(repo)["killed-run"]["metrics"]["metrics/eval.json"]
    for bad, word in (({"train.lrr": 0.1}, "train.lrr"), ({"train.lr": -1}, "train.lr")):
        proc = prefect.cli("deployment", "run", "train/main", "--params", json.dumps({"overrides": bad}), check=False)
        assert proc.returncode != 0 and word in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.slow
def test_concurrent_runs_are_serialized(prefect, killed_run, tmp_path):
    """Two runs with different overrides started together on one repository: one waits for the other, both
    complete, and each experiment holds its own params."""
    repo = tmp_path / "repo"
    shutil.copytree(killed_run["repo"], repo, symlinks=True)
    a = prefect.start_run(repo, {"train.lr": 0.02, "flows.retry_delay_s": 2}, "run-a")
    b = prefect.start_run(repo, {"train.lr": 0.02, "flows.retry_delay_s": 4}, "run-b")
    outs = [p.communicate(timeout=600)[0] for p in (a, b)]
    assert [p.returncode for p in (a, b)] == [0, 0], "\n".join(o[-3000:] for o in outs)
    logs = {name: prefect.logs_of(run_id(o)) for name, o in zip(("run-a", "run-b"), outs)}
    waited = [name for name, text in logs.items() if "is queued and waits for it" in text]
    assert len(waited) == 1, logs
    other = ({"run-a", "run-b"} - set(waited)).pop()
    assert f"flow run '{other}'" in logs[waited[0]]
    exps = experiments(repo)
    for name, delay in (("run-a", 2), ("run-b", 4)):
        assert exps[name]["params"]["flows"]["retry_delay_s"] == delay
        assert exps[name]["metrics"]["metrics/eval.json"]["bbox"]
    assert (repo / "params.yaml").read_text() == killed_run["params_before"]
    assert not (repo / ".dvc/tmp/flows/params.yaml.orig").exists()
