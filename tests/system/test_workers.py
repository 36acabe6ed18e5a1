"""Workers anywhere: runs of a ``--source`` deployment on a Prefect ``process`` work pool pull their inputs from
and push their results to the team's remotes (`detpipe.orchestration.remotes`).

The slow tests stand up what a team has: a bare git repository as ``origin``, SeaweedFS as the DVC remote
(``tests/support/s3server.py``), the session's Prefect server, a ``process`` work pool with two workers started
from different directories, and ``train/team`` registered with ``python -m flows.serve --work-pool gpu --source
<origin> --name team`` (``train/main`` is the checkout's deployment served by tests/system/test_flows.py).
Every run happens in the temporary clone a worker makes and deletes; what is left afterwards is only what was
pushed. Fast tests check `detpipe.orchestration.remotes.check` on small local repositories.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest
import yaml

from support import prebuild
from support.prefect import Prefect, run_id
from support.procs import free_ports, run as sh, stop_group
from support.repos import make_repo

from detpipe.orchestration import remotes as rm

TRAIN = {"epochs": 10, "checkpoint_every": 1}      # 20 iterations: room to kill the run after a pushed checkpoint
A_OVERRIDES = {"train.lr": 0.02}
B_OVERRIDES = {"train.lr": 0.03, "train.epochs": 1}  # train params only; B stops after training (upto)


# ---------------------------------------------------------------------------------------------- fast tests

def _tiny_repo(path: Path) -> Path:
    path.mkdir()
    sh(["git", "init", "-q", "-b", "main"], path)
    sh([sys.executable, "-m", "dvc", "init", "-q"], path)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-qm", "init"], path)
    return path


def test_check_names_the_missing_setting(tmp_path):
    """No git remote, no default DVC remote, a local DVC remote folder that does not exist: one line each,
    naming the setting; a working pair passes and gives the remotes' URLs."""
    repo = _tiny_repo(tmp_path / "repo")
    with pytest.raises(rm.RemoteError, match=r"no git remote 'origin'"):
        rm.check(repo)
    sh(["git", "init", "-q", "--bare", str(tmp_path / "origin.git")], tmp_path)
    sh(["git", "remote", "add", "origin", str(tmp_path / "origin.git")], repo)
    with pytest.raises(rm.RemoteError, match=r"\.dvc/config: no default DVC remote \(core\.remote\)") as e:
        rm.check(repo)
    assert "\n" not in str(e.value)
    sh([sys.executable, "-m", "dvc", "remote", "add", "-d", "team", str(tmp_path / "nowhere")], repo)
    with pytest.raises(rm.RemoteError, match=r"DVC remote 'team': folder .*nowhere does not exist"):
        rm.check(repo)
    (tmp_path / "nowhere").mkdir()
    got = rm.check(repo)
    assert got.git_url == str(tmp_path / "origin.git") and got.dvc_url == str(tmp_path / "nowhere")
    assert got.uri("0123456789abcdef") == f"{tmp_path / 'nowhere'}/files/md5/01/23456789abcdef"


def test_check_unreachable_git_remote(tmp_path):
    repo = _tiny_repo(tmp_path / "repo")
    sh(["git", "remote", "add", "origin", str(tmp_path / "gone.git")], repo)
    t0 = time.monotonic()
    with pytest.raises(rm.RemoteError, match=r"git remote 'origin' \(.*gone\.git\) unreachable"):
        rm.check(repo)
    assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------------------------------------- the team

def _worker(prefect, name: str, cwd: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in prefect.env.items() if k != "PYTHONPATH"}    # code comes from the worker's clone
    env["PREFECT_WORKER_QUERY_SECONDS"] = "2"
    with open(prefect.logs / f"{name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "gpu", "--name", name],
                                env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    prefect.procs.append(proc)
    return proc


def _register(prefect, *argsets: list[str]) -> list[subprocess.CompletedProcess]:
    """``python -m flows.serve --work-pool gpu <args>`` for each of ``argsets``, all at once; their results."""
    procs = [subprocess.Popen([sys.executable, "-m", "flows.serve", "--work-pool", "gpu", *args], env=prefect.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2]) for args in argsets]
    outputs = [p.communicate(timeout=300) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]


def _run(prefect, deployment: str, overrides: dict, name: str, **params) -> str:
    out = prefect.cli("deployment", "run", deployment, "--params", json.dumps({"overrides": overrides, **params}),
                      "--flow-run-name", name).stdout
    return run_id(out)


def _set_crashed(prefect, run: str) -> None:
    code = ("import sys\nfrom prefect.client.orchestration import get_client\nfrom prefect.states import Crashed\n"
            "with get_client(sync_client=True) as c:\n"
            "    c.set_flow_run_state(sys.argv[1], Crashed(message='its worker was killed'), force=True)\n")
    subprocess.run([sys.executable, "-c", code, run], env=prefect.env, check=True, timeout=120)


def _remote_exps(origin: Path) -> dict[str, str]:
    out = sh(["git", "ls-remote", str(origin), "refs/exps/*"], origin).stdout
    return {ln.split("\t")[1].rsplit("/", 1)[1]: ln.split("\t")[0] for ln in out.splitlines()}


def _procs_of(run: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("PREFECT__FLOW_RUN_ID") == run:
                found.append(p)
    return found


def _workers_team(factory) -> dict:
    """The team (see the module docstring) and its runs: A, whose worker is killed after A's first pushed
    checkpoint and which is retried on the other worker; a run of a deployment whose DVC remote does not
    answer (at the same time as A); then B, a run of ``train/team`` with other train params up to training.
    Built once per session, in the background while other modules' tests run (`support.prebuild`); the workers
    are stopped before it returns (what the tests inspect is on the server and the remotes)."""
    s3_server, prefect_api = prebuild.get("s3_server"), prebuild.get("prefect_api")
    work = factory.mktemp("workers")
    origin = work / "origin.git"
    sh(["git", "init", "-q", "--bare", "-b", "main", str(origin)], work)
    repo = make_repo(work / "repo", train=TRAIN)
    bucket = s3_server.create_bucket()
    sh(["dvc", "remote", "modify", "s3", "url", f"s3://{bucket}/dvc"], repo)
    sh(["dvc", "remote", "modify", "s3", "endpointurl", s3_server.endpoint_url], repo)
    sh(["dvc", "remote", "default", "s3"], repo)
    sh(["git", "commit", "-qam", "team remote: SeaweedFS"], repo)
    sh(["git", "remote", "add", "origin", str(origin)], repo)
    sh(["git", "push", "-q", "origin", "main"], repo)
    sh(["git", "checkout", "-q", "-b", "deadremote"], repo)
    sh(["dvc", "remote", "modify", "s3", "endpointurl", f"http://127.0.0.1:{free_ports(1)[0]}"], repo)
    sh(["git", "commit", "-qam", "remote nobody answers"], repo)
    sh(["git", "push", "-q", "origin", "deadremote"], repo)

    # the session's server, with the team's S3 credentials and its own processes (the workers)
    prefect = Prefect({**prefect_api.env, **s3_server.env()}, prefect_api.logs)
    try:
        url = f"file://{origin}"
        # the first registration creates the pool and the crash automation; the others then run at once
        [registered] = _register(prefect, ["--source", url, "--name", "team"])
        assert registered.returncode == 0, registered.stdout + registered.stderr
        workers = {w: _worker(prefect, w, work / f"{w}-cwd") for w in ("w1", "w2")}
        dead_reg, refused = _register(prefect, ["--source", url, "--branch", "deadremote"],
                                      ["--name", "team"])   # the checkout under the same name train/team
        assert dead_reg.returncode == 0, dead_reg.stdout + dead_reg.stderr

        a = _run(prefect, "train/team", A_OVERRIDES, "run-a")
        dead = _run(prefect, "train/deadremote", {}, "run-dead")
        deadline = time.monotonic() + 600
        # the first pushed checkpoint: on the git remote, and its log line at the server (the kill must not
        # come between the push and the line reaching the API, or the test would not know what was pushed)
        while "run-a" not in _remote_exps(origin) or "pushed checkpoints up to" not in prefect.logs_of(a):
            assert time.monotonic() < deadline, prefect.logs_of(a)[-5000:]
            assert prefect.flow_run(a)["state"]["type"] in ("SCHEDULED", "PENDING", "RUNNING"), \
                prefect.logs_of(a)[-5000:]
            time.sleep(0.2)
        procs = _procs_of(a)
        training = any("stages.train" in " ".join(p.cmdline()) for p in procs if p.is_running())
        killed = next(w for w, proc in workers.items()
                      if any(p.pid in {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
                             for p in procs))
        workers[killed].send_signal(signal.SIGKILL)
        workers[killed].wait()
        left = psutil.wait_procs(procs, timeout=40)[1]
        final_dead = prefect.wait_final(dead, timeout=300)
        dead_s = (datetime.fromisoformat(final_dead["end_time"])           # from its start to its failure
                  - datetime.fromisoformat(final_dead["start_time"])).total_seconds()
        _set_crashed(prefect, a)
        first_attempt = prefect.logs_of(a)
        prefect.cli("flow-run", "retry", a)
        final_a = prefect.wait_final(a, timeout=900)
        b = _run(prefect, "train/team", B_OVERRIDES, "run-b", upto="train")
        return {"work": work, "origin": origin, "bucket": bucket, "env": s3_server.env(), "prefect": prefect,
                "s3": s3_server, "refused": refused, "a": a, "final_a": final_a, "result_a": prefect.result(a),
                "logs_a": prefect.logs_of(a), "first_attempt": first_attempt, "training_at_kill": training,
                "killed": killed, "left": left, "b": b, "final_b": prefect.wait_final(b, timeout=600),
                "logs_b": prefect.logs_of(b),
                "worker_logs": {w: (prefect.logs / f"{w}.log").read_text() for w in workers},
                "dead": final_dead, "dead_s": dead_s, "dead_logs": prefect.logs_of(dead)}
    finally:                                        # the workers; the server is the session's
        stop_group(prefect.procs)


prebuild.register("workers_team", _workers_team, shared=False)    # runs on this process's Prefect server


@pytest.fixture(scope="module")
def workers_team(s3_server, prefect_api):
    """`_workers_team`'s runs and what they left (built in the background, or here if it has not started)."""
    return prebuild.get("workers_team")


@pytest.mark.slow
def test_killed_worker_retry_resumes_on_the_other_worker(workers_team):
    """A's worker is killed (SIGKILL) mid-training after a checkpoint was pushed: every process of the run dies
    with it; the retry runs on the other worker, starts from the pushed partial experiment, skips the finished
    stages, resumes training from the pushed checkpoint and completes."""
    assert workers_team["training_at_kill"], workers_team["first_attempt"][-4000:]
    assert workers_team["left"] == [], workers_team["left"]
    other = ({"w1", "w2"} - {workers_team["killed"]}).pop()
    assert workers_team["a"] in workers_team["worker_logs"][other], workers_team["worker_logs"][other][-3000:]
    assert workers_team["final_a"]["state"]["type"] == "COMPLETED", workers_team["logs_a"][-6000:]
    assert "starting fresh: no checkpoint" in workers_team["first_attempt"]
    pushed = re.findall(r"pushed checkpoints up to (ckpt-\d+)\.pt", workers_team["first_attempt"])
    assert pushed, workers_team["first_attempt"][-4000:]
    marker = "experiment 'run-a' is on origin"
    assert marker in workers_team["logs_a"], workers_team["logs_a"][-6000:]
    retry = workers_team["logs_a"][workers_team["logs_a"].index(marker):]
    for stage in ("download", "convert", "augment"):
        assert f"Stage '{stage}' didn't change, skipping" in retry, stage
    resumed = re.search(r"resuming from checkpoints/(ckpt-\d+)\.pt", retry)
    assert resumed and resumed.group(1) >= pushed[0] and "starting fresh" not in retry, retry[-6000:]
    assert workers_team["result_a"]["stages"]["train"] == "ran"


@pytest.mark.slow
def test_run_is_pulled_in_a_fresh_clone_and_equals_an_uninterrupted_run(workers_team):
    """A's result and artifact name the experiment, its git ref and S3 URIs (no path on the worker); a fresh
    clone gets A's metrics and model with ``dvc exp pull`` + ``dvc exp apply`` + ``dvc pull``, hash-equal; and
    training there again from scratch, uninterrupted, writes the very same model.pt bytes."""
    result = workers_team["result_a"]
    assert result["experiment"] == "run-a" and result["ref"].startswith("refs/exps/")
    assert result["git_remote"] == f"file://{workers_team['origin']}"
    assert result["dvc_remote"] == f"s3://{workers_team['bucket']}/dvc"
    model = result["outputs"]["models/model.pt"]
    assert model["remote"] == f"s3://{workers_team['bucket']}/dvc/files/md5/{model['md5'][:2]}/{model['md5'][2:]}"
    artifact = workers_team["prefect"].artifact(workers_team["a"], "train-results")
    for text in (json.dumps(result), artifact):     # no path of the worker's temporary clone (tmp...prefect/)
        assert not re.search(r"tmp\w*prefect|\.dvc/(cache|tmp)|/files/md5/", text.replace(
            f"s3://{workers_team['bucket']}/dvc/files/md5/", "S3")), text[:3000]
    assert model["remote"] in artifact and "dvc exp pull origin run-a" in artifact
    origin = workers_team["origin"]
    assert _remote_exps(origin)["run-a"] == sh(["git", "ls-remote", str(origin), result["ref"]],
                                              workers_team["work"]).stdout.split()[0]

    clone = workers_team["work"] / "fresh"
    sh(["git", "clone", "-q", str(origin), str(clone)], workers_team["work"])
    env = {**os.environ, **workers_team["env"], "PYTHONPATH": ""}
    for cmd in (["exp", "pull", "origin", "run-a"], ["exp", "apply", "run-a"], ["pull"]):
        proc = subprocess.run([sys.executable, "-m", "dvc", *cmd], cwd=clone, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, (cmd, proc.stdout, proc.stderr)
    assert hashlib.md5((clone / "models/model.pt").read_bytes()).hexdigest() == model["md5"]
    assert json.loads((clone / "metrics/eval.json").read_text())["bbox"] == result["metrics"]
    assert yaml.safe_load((clone / "params.yaml").read_text())["train"]["lr"] == 0.02

    shutil.rmtree(clone / "checkpoints")                               # train again from scratch, uninterrupted
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "train"], cwd=clone,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "starting fresh" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    assert hashlib.md5((clone / "models/model.pt").read_bytes()).hexdigest() == model["md5"]   # bit for bit


@pytest.mark.slow
def test_second_run_restores_the_unchanged_stages(workers_team):
    """Run B (only train params differ from A) starts in a fresh clone of origin: DVC restores download,
    convert and augment from the remote run-cache instead of running them, then trains with B's params."""
    logs = workers_team["logs_b"]
    assert workers_team["final_b"]["state"]["type"] == "COMPLETED", logs[-6000:]
    for stage in ("download", "convert", "augment"):
        assert f"Stage '{stage}' is cached - skipping run" in logs and f"Running stage '{stage}'" not in logs, stage
    assert "Running stage 'train'" in logs and "wrote models/model.pt after 2 iterations" in logs, logs[-4000:]


@pytest.mark.slow
def test_each_source_its_own_deployment(workers_team):
    """Registering this checkout as train/team while train/team runs code from the git origin is refused."""
    refused = workers_team["refused"]
    assert refused.returncode != 0
    origin = workers_team["origin"]
    assert f"deployment train/team runs code from file://{origin}@main" in refused.stderr, refused.stderr


@pytest.mark.slow
def test_unreachable_remote_fails_in_seconds(workers_team):
    """A run whose DVC remote does not answer fails before any stage, with one line naming the remote."""
    assert workers_team["dead"]["state"]["type"] == "FAILED"
    message = workers_team["dead"]["state"]["message"]
    assert "DVC remote 's3' (s3://" in message and "unreachable" in message and "\n" not in message, message
    assert "Running stage" not in workers_team["dead_logs"]
    assert workers_team["dead_s"] < 60, workers_team["dead_s"]  # the probe: 5 s connect timeout, botocore's retries


@pytest.mark.slow
def test_logs_follows_a_run_with_its_stages_output(workers_team):
    """``python -m flows.logs <name>`` prints the run's log with the stages' own output (both attempts) and
    exits 0 for a Completed run; 2 for a run that does not exist."""
    prefect = workers_team["prefect"]
    proc = subprocess.run([sys.executable, "-m", "flows.logs", "run-a", "--poll", "0.5"], env=prefect.env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for line in ("Running stage 'convert'", "detpipe.engine.hooks INFO saved checkpoint", "resuming from checkpoints/",
                 "pushed checkpoints up to", "onnx parity"):
        assert line in proc.stdout, line
    for line in ("saved checkpoint", "Running stage", "files pushed"):       # each line once: none lost or doubled
        assert proc.stdout.count(line) == workers_team["logs_a"].count(line) > 0, line
    missing = subprocess.run([sys.executable, "-m", "flows.logs", "no-such-run"], env=prefect.env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no flow run 'no-such-run'" in missing.stderr
