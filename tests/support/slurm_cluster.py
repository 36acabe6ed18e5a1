"""A real Slurm cluster on this machine for the tests: munged, slurmctld and one slurmd from the distribution's
packages (Debian ``slurm-wlm``, ``munge``), all state in a temporary directory, stopped at the end.

One node (this host, addressed as 127.0.0.1) with 2 CPUs: a Debian ``slurmd`` cannot run twice on one host
(that needs a Slurm built with ``--enable-multiple-slurmd``), so a "two-node" job is 1 node x 2 tasks, i.e.
two torchrun agents meeting at the c10d rendezvous as two nodes would.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

from support import reaper
from support.procs import free_port


def slurm_available() -> str | None:
    """None when the Slurm and munge daemons are installed, else what is missing."""
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
               if not shutil.which(b) and not Path(f"/usr/sbin/{b}").exists()]
    return f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge; .ci/run does)" if missing else None


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@contextlib.contextmanager
def slurm_cluster(root: Path, cpus: int = 2) -> Iterator[dict]:
    """Start munged + slurmctld + slurmd with state under ``root``; yield the environment (``SLURM_CONF``) for
    the Slurm commands; stop all three (and cancel leftover jobs) on exit."""
    root = Path(root)
    for d in ("state", "spool", "log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    reaper.guard_dir(root)   # slurmstepd hides its environment: a killed pytest's watchdog finds it by its files
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge.sock"
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=detpipetest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = []
    try:
        procs.append(subprocess.Popen([_exe("munged"), "--foreground", "--force", f"--socket={sock}",
                                       f"--key-file={key}", f"--pid-file={root}/munged.pid",
                                       f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge.seed"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _until(lambda: sock.exists(), 30, "munged did not start", root)
        procs.append(subprocess.Popen([_exe("slurmctld"), "-D", "-i", "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen([_exe("slurmd"), "-D", "-f", str(conf), "-N", host], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            return out.strip() in ("idle", "mixed", "allocated")

        _until(idle, 90, "the slurm node did not become idle", root)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _until(check, timeout: float, message: str, root: Path) -> None:
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((root / "log").glob("*.log")))
            raise RuntimeError(f"{message}\n{logs}")
        time.sleep(0.3)
