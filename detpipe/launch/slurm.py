"""Slurm: the sbatch script of a training job, and running it from the train stage (submit, stream the log,
wait, cancel when stopped).

The script (`sbatch_script`) asks for ``MAX / train.slurm_tasks_per_node`` nodes of ``train.nnodes`` (``N`` or
``MIN:MAX``; it counts torchrun agents, one per Slurm task, normally one per node: a ``--nodes=MIN-MAX`` range was
given its minimum by Slurm 22.05 even with idle nodes, measured in tests/system/test_cluster.py) with
``train.slurm_tasks_per_node`` tasks each; ``srun`` starts one torchrun agent per task with the same arguments
as a local launch (`detpipe.launch.torchrun_args.torchrun_args`), the c10d rendezvous on the job's first node at the port
of ``train.rdzv_endpoint`` and ``$SLURM_JOB_ID`` as rendezvous id. A failed worker or node: torchrun restarts
the worker group (``--max-restarts``) and, an elastic job being submitted with ``--no-kill``, goes on with the
remaining nodes down to MIN;
when the whole job dies (e.g. the first node, which hosts the rendezvous) ``--requeue`` puts it back in the
queue. Every start resumes from the newest checkpoint. The log goes to ``<workdir>/logs/slurm-<job id>.out``.
"""
from __future__ import annotations

import logging
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from detpipe.core.errors import Interrupted, StageError
from detpipe.core.files import atomic_write_bytes
from detpipe.launch.torchrun_args import AGENT_MODULE, parse_nnodes

log = logging.getLogger("detpipe.launch.slurm")

LOG_DIR = "logs"
# JobState values after which the job will not run again (a requeued job goes back to PENDING instead).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"}


def _shell_word(arg: str) -> str:
    # "${VAR}" parts stay expandable (double quotes); everything else is quoted literally
    return f'"{arg}"' if "${" in arg and '"' not in arg else shlex.quote(arg)


def sbatch_script(cfg, torchrun_argv: list[str], env: dict[str, str], workdir: Path) -> str:
    """The sbatch script text for params ``cfg`` (`detpipe.params.Train`).

    Args:
        torchrun_argv: torchrun's arguments; ``${RDZV_HOST}`` (the job's first node, set by the script) and
            ``${SLURM_JOB_ID}`` in them are expanded by the shell.
        env: variables exported for the workers (`detpipe.launch.torchrun_args.launch_env`).
        workdir: the run's folder (repository root): the job runs there and logs to ``workdir/logs``.
    """
    lo, hi = parse_nnodes(cfg.nnodes)
    tasks = cfg.slurm_tasks_per_node
    if lo % tasks or hi % tasks:
        raise StageError(f"params.yaml: train.nnodes {cfg.nnodes!r} (torchrun agents = Slurm tasks) is not a multiple "
                         f"of train.slurm_tasks_per_node {tasks}")
    lo, hi = lo // tasks, hi // tasks
    workdir = Path(workdir).resolve()
    opts = ["--job-name=detpipe-train", f"--nodes={hi}",
            f"--ntasks-per-node={cfg.slurm_tasks_per_node}", f"--time={cfg.slurm_time}", "--requeue",
            "--open-mode=append", f"--chdir={workdir}", f"--output={workdir}/{LOG_DIR}/slurm-%j.out"]
    # an elastic job goes on without a failed node (torchrun admits MIN); a fixed-size one cannot: Slurm ends it
    # and, with --requeue, starts it again on nodes that are up
    opts += ["--no-kill"] if lo < hi else []
    opts += [f"--partition={cfg.slurm_partition}"] if cfg.slurm_partition else []
    opts += [f"--cpus-per-task={cfg.slurm_cpus_per_task}"] if cfg.slurm_cpus_per_task else []
    opts += list(cfg.slurm_extra)
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    torchrun = " ".join([shlex.quote(sys.executable), "-m", AGENT_MODULE] + [_shell_word(a) for a in torchrun_argv])
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
             "# Written by `python -m detpipe.launch.emit slurm` for the current params.yaml (docs/multi-node.md).",
             "set -euo pipefail",
             f"export {exports}",
             'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             "# the address Slurm itself reaches the node at (NodeAddr; the node's name when none is configured)",
             'RDZV_HOST=$(scontrol show node -o "$FIRST_NODE" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
             'RDZV_HOST=${RDZV_HOST:-$FIRST_NODE}',
             'echo "slurm job $SLURM_JOB_ID (start $((${SLURM_RESTART_COUNT:-0} + 1))) on $SLURM_JOB_NODELIST,'
             ' rendezvous on $RDZV_HOST"',
             f"srun --kill-on-bad-exit=0 --ntasks-per-node={cfg.slurm_tasks_per_node} {torchrun}", ""]
    return "\n".join(lines)


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise StageError(f"{cmd[0]}: not found (train.launcher is 'slurm': run on a Slurm login node)") from None


def submit(script: Path) -> str:
    """``sbatch --parsable <script>``; returns the job id. Raises `StageError` with sbatch's message."""
    proc = _run(["sbatch", "--parsable", str(script)])
    if proc.returncode != 0:
        raise StageError(f"{script}: sbatch failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


def job_state(job_id: str) -> tuple[str, str]:
    """``(JobState, ExitCode)`` of a job from ``scontrol show job`` (e.g. ``("RUNNING", "0:0")``);
    ``("UNKNOWN", "")`` once Slurm has forgotten it (MinJobAge)."""
    proc = _run(["scontrol", "show", "job", "-o", job_id])
    state = re.search(r"\bJobState=(\S+)", proc.stdout)
    code = re.search(r"\bExitCode=(\S+)", proc.stdout)
    return (state.group(1) if state else "UNKNOWN"), (code.group(1) if code else "")


def cancel(job_id: str, timeout_s: float = 120) -> None:
    """``scancel`` the job and wait (at most ``timeout_s`` seconds) until ``squeue`` no longer lists it."""
    _run(["scancel", job_id])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _run(["squeue", "-h", "-j", job_id, "-o", "%i"]).stdout.strip():
            return
        time.sleep(0.5)
    log.warning("slurm job %s still listed by squeue %.0f s after scancel", job_id, timeout_s)


def _raise_stop(signum, frame):
    raise Interrupted(signum)


def run_job(script_text: str, workdir: Path, poll_s: float = 1.0) -> None:
    """Submit ``script_text`` (written to ``workdir/logs/train.sbatch``), copy the job's log to stdout as it
    grows, and return when the job has COMPLETED. On SIGTERM or SIGINT (a cancelled Prefect flow run stops its
    stage that way) the job is cancelled (`cancel`) before this returns.

    Raises:
        StageError: sbatch failed; the job ended in another state (its state, exit code and log are named).
        Interrupted: SIGTERM/SIGINT stopped this process; the job was cancelled first (`detpipe.core.errors.run_program`
            then exits with 128 + signal).
    """
    logs = Path(workdir).resolve() / LOG_DIR
    script = logs / "train.sbatch"
    atomic_write_bytes(script, script_text.encode())
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    job_id, offset, state = None, 0, ("PENDING", "")
    try:
        job_id = submit(script)
        log_path = logs / f"slurm-{job_id}.out"
        log.info("submitted slurm job %s (%s); log %s", job_id, script, log_path)
        while True:
            state = job_state(job_id)
            offset = _copy_new(log_path, offset)
            if state[0] in FINAL_STATES or state[0] == "UNKNOWN":
                break
            time.sleep(poll_s)
        offset = _copy_new(log_path, offset)
    except Interrupted as e:
        if job_id is not None:
            log.warning("%s: cancelling slurm job %s", signal.Signals(e.signum).name, job_id)
            cancel(job_id)
            _copy_new(logs / f"slurm-{job_id}.out", offset)
        raise Interrupted(e.signum, f"in stage train; slurm job {job_id} cancelled") from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if state[0] != "COMPLETED":
        raise StageError(f"slurm job {job_id} ended {state[0]} (exit code {state[1]}); log: {log_path}")
    log.info("slurm job %s completed", job_id)


def _copy_new(path: Path, offset: int) -> int:
    """Write ``path``'s bytes from ``offset`` on to stdout; return the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    if data:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return offset + len(data)
