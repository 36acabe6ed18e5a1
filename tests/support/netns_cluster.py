"""A small real cluster on this machine for the tests: hosts that are Linux network namespaces on one bridge.

Each host is a network namespace with its own interface ``eth0``, its own IPv4 address in a /24 of
198.18.0.0/15 (RFC 2544's benchmarking range: nothing on a real network uses it) and, for every process started
on it (`Cluster.popen`), its own hostname (a UTS namespace per process tree: ``unshare --uts``). The hosts share
this machine's filesystem: what a cluster's shared filesystem (NFS, Lustre) gives, so ``checkpoints/`` and the
repository are "on every node". The bridge lives in a namespace of its own; this test process reaches the
hosts through one more veth whose end in this (root) namespace gets the subnet's ``.254`` (the S3 uploads, the
readiness probes). No address outside the subnet and 127.0.0.0/8 is ever used.

    with network(tmp, ["ctl", "c1", "c2", "st"]) as cluster:
        cluster.addr("c1")                              # "198.18.N.11"
        proc = cluster.popen("c1", ["python", "-m", "stages.train"], cwd=work)
        cluster.link("c2", up=False)                    # a cut link: packets dropped, no TCP reset
        cluster.kill("c2")                              # SIGKILL every process on the host

`slurm` adds munged (this namespace: its socket is a file every host reaches), ``slurmctld`` on ``ctl`` and one
``slurmd`` per compute host (``-N cN``: per-node spool, pid and log files through Slurm's ``%n``); `s3` runs the
SeaweedFS S3 server on the storage host. Teardown kills every process left in the hosts' namespaces (``ip netns
pids``) and deletes the namespaces, which removes their interfaces and the bridge. Namespaces left by a test run
that was killed (SIGKILL: no teardown) carry its pid in their name and are removed by the next run's `network`;
their processes die with the run anyway (`support.reaper`: they inherit its token).
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from support import reaper

PREFIX = "dpt"
"""Names of this module's namespaces: ``dpt<pid>-<host>`` (pid: the test process that created them)."""
HOST_NUMBERS = {"ctl": 1, "c1": 11, "c2": 12, "c3": 13, "st": 20}
"""Last octet of each host's address."""
ROOT_HOST = 254
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0


def netns_available() -> str | None:
    """None when this process can build the cluster (root, ``ip``, ``unshare``, network namespaces), else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [b for b in ("ip", "unshare", "nsenter", "ss") if not shutil.which(b)]
    if missing:
        return f"not installed: {', '.join(missing)} (iproute2, util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else f"cannot create a network namespace: {made.stderr.strip()}"


def slurm_available() -> str | None:
    """None when the Slurm and munge programs are installed, else what is missing."""
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
               if not shutil.which(b) and not Path(f"/usr/sbin/{b}").exists()]
    return f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge; .ci/run does)" if missing else None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def namespaces() -> list[str]:
    """The names of this machine's named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _pids(ns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def _kill_all(ns: str, keep: set[int] = frozenset(), timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGKILL every process in namespace ``ns`` but ``keep`` (again, until none is left or ``timeout`` s passed)."""
    deadline = time.monotonic() + timeout
    while (pids := set(_pids(ns)) - keep) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _remove(names: list[str]) -> None:
    for ns in names:
        _kill_all(ns)
    for ns in names:
        _ip("netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces of test runs that no longer exist (their pid in the name is gone); returns them."""
    stale = [ns for ns in namespaces() if (m := re.fullmatch(rf"{PREFIX}(\d+)-\w+", ns))
             and not _alive(int(m.group(1)))]
    _remove(stale)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 198.18.0.0/15 that no route of this namespace uses (two test runs at once get different ones)."""
    used = _ip("-4", "route").stdout
    start = os.getpid() % 256
    for i in range(512):
        net = ipaddress.ip_network(f"198.{18 + (start + i) // 256 % 2}.{(start + i) % 256}.0/24")
        if str(net) not in used:
            return net
    raise RuntimeError("no free /24 in 198.18.0.0/15")


@dataclass
class Cluster:
    """Hosts (network namespaces) on one bridge; see the module docstring."""

    tag: str
    subnet: ipaddress.IPv4Network
    hosts: list[str]
    root_if: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    daemons: set[int] = field(default_factory=set)

    def ns(self, host: str) -> str:
        """The network namespace of ``host``."""
        return f"{self.tag}-{host}"

    def addr(self, host: str) -> str:
        """``host``'s IPv4 address (``"root"``: this test process's end of the bridge)."""
        return str(self.subnet.network_address + (ROOT_HOST if host == "root" else HOST_NUMBERS[host]))

    def argv(self, host: str, cmd: list[str]) -> list[str]:
        """``cmd`` run on ``host``: in its network namespace, in a new UTS namespace whose hostname is ``host``."""
        # nsenter, not `ip netns exec`: that one also remounts /sys for the namespace, which hides
        # /sys/fs/cgroup (slurmd refuses to start without it)
        return ["nsenter", f"--net=/run/netns/{self.ns(host)}", "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *map(str, cmd)]

    def popen(self, host: str, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` on ``host`` (`subprocess.Popen` keyword arguments as given; its own session unless told
        otherwise); the cluster's teardown kills it if it is still running."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(host, cmd), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, host: str, cmd: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` on ``host`` to its end; output captured as text."""
        return subprocess.run(self.argv(host, cmd), capture_output=True, text=True, timeout=timeout, **kwargs)

    def link(self, host: str, up: bool) -> None:
        """Set ``host``'s ``eth0`` up or down. Down is a cut cable: the host's packets go nowhere and nothing
        answers its peers (no TCP reset, no ICMP): their connections to it just stop."""
        _ip("-n", self.ns(host), "link", "set", "eth0", "up" if up else "down")

    def pids(self, host: str) -> list[int]:
        """Every process running on ``host`` (in its network namespace)."""
        return _pids(self.ns(host))

    def kill(self, host: str) -> None:
        """SIGKILL every process on ``host`` but the cluster's daemons (`daemons`: its ``slurmd``): the machine
        lost its power, and the next test finds it back in the cluster."""
        _kill_all(self.ns(host), self.daemons)

    def listening(self, host: str) -> list[str]:
        """``ss -Htlnp`` inside ``host``'s namespace: ``local address:port`` and process of each listening TCP
        socket."""
        out = subprocess.run(["nsenter", f"--net=/run/netns/{self.ns(host)}", "ss", "-Htlnp"], capture_output=True,
                             text=True, timeout=30).stdout
        return [" ".join(line.split()[3:4] + line.split()[5:6]) for line in out.splitlines() if line.strip()]


@contextlib.contextmanager
def network(hosts: list[str]) -> Iterator[Cluster]:
    """Create ``hosts`` (names from `HOST_NUMBERS`) on a bridge, with this process's end at ``.254``; yield the
    `Cluster`; kill everything left on them and delete them at the end (also when the body raises)."""
    remove_stale()
    tag = f"{PREFIX}{os.getpid()}"
    switch = f"{tag}-sw"
    if any(ns.startswith(f"{tag}-") for ns in namespaces()):
        raise RuntimeError(f"namespaces {tag}-* exist already (one cluster per test process at a time)")
    subnet = _free_subnet()
    cluster = Cluster(tag=tag, subnet=subnet, hosts=list(hosts), root_if=f"{tag}r")
    made = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host in hosts:
            ns = cluster.ns(host)
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", switch, "link", "add", f"v-{host}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", switch, "link", "set", f"v-{host}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{cluster.addr(host)}/{subnet.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # this process's way in: a veth whose other end is on the bridge (deleted with the switch namespace)
        _ip("link", "add", cluster.root_if, "type", "veth", "peer", "name", "v-root", "netns", switch)
        _ip("-n", switch, "link", "set", "v-root", "master", "br0", "up")
        _ip("addr", "add", f"{cluster.addr('root')}/{subnet.prefixlen}", "dev", cluster.root_if)
        _ip("link", "set", cluster.root_if, "up")
        yield cluster
    finally:
        for proc in cluster.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        _remove(made[1:] + made[:1])
        for proc in cluster.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_TIMEOUT_S)
        _ip("link", "del", cluster.root_if, check=False)


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@contextlib.contextmanager
def slurm(cluster: Cluster, root: Path, computes: list[str], cpus: int = 2, cred_expire_s: int = 10) -> Iterator[dict]:
    """munged (here), ``slurmctld`` on host ``ctl`` and a ``slurmd`` on each of ``computes``, state under
    ``root``; yield the environment (``SLURM_CONF``) of the Slurm commands (they work from any host and from this
    process). Jobs are cancelled and the daemons stopped at the end.

    Nodes: ``NodeName=cN NodeAddr=<its address>`` with ``cpus`` CPUs each; ``ReturnToService=1`` (a node DOWN
    because it did not respond is usable again when its slurmd registers; one an admin set DOWN stays DOWN until
    ``state=resume``); ``JobRequeue=1`` with ``--requeue`` jobs put back in the queue when a
    node fails under them; a requeued job becomes eligible ``cred_expire_s`` seconds later (Slurm waits until the
    job's old step credentials have expired: ``AuthInfo=cred_expire``, 120 s by default; short here) and is
    started by the next full scheduling pass (``SchedulerParameters=sched_interval``, 60 s by default; 2 s here:
    nothing else wakes the scheduler when the begin time passes)."""
    root = Path(root)
    for d in ("state", "spool", "log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    reaper.guard_dir(root)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge.sock"
    nodes = "\n".join(f"NodeName={c} NodeAddr={cluster.addr(c)} CPUs={cpus} State=UNKNOWN" for c in computes)
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=detpipecluster
SlurmctldHost=ctl({cluster.addr('ctl')})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire={cred_expire_s}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=1
JobRequeue=1
MinJobAge=600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
{nodes}
PartitionName=test Nodes={','.join(computes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = []
    try:
        daemons.append(subprocess.Popen([_exe("munged"), "--foreground", "--force", f"--socket={sock}",
                                         f"--key-file={key}", f"--pid-file={root}/munged.pid",
                                         f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge.seed"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        _until(sock.exists, 30, "munged did not start", root)
        daemons.append(cluster.popen("ctl", [_exe("slurmctld"), "-D", "-i", "-f", conf], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for c in computes:
            (root / "spool" / c).mkdir(exist_ok=True)
            daemons.append(cluster.popen(c, [_exe("slurmd"), "-D", "-f", conf, "-N", c], env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            cluster.daemons.add(daemons[-1].pid)   # nsenter, unshare and sh exec: the pid is slurmd's

        def idle() -> bool:
            states = node_states(env)
            return sorted(states) == sorted(computes) and all(s == "idle" for s in states.values())

        _until(idle, START_TIMEOUT_S, f"the slurm nodes {computes} did not all become idle", root)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True, timeout=30)
        for p in reversed(daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(daemons):
            try:
                p.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def squeue(env: dict) -> str:
    """``squeue``'s ``job id, state, nodes`` lines (empty when no job is queued or running)."""
    return subprocess.run(["squeue", "-h", "-o", "%i %T %N"], env=env, capture_output=True, text=True,
                          timeout=30).stdout


def node_states(env: dict) -> dict[str, str]:
    """``sinfo``'s state of each node, e.g. ``{"c1": "idle", "c2": "down*"}`` (``*``: not responding)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def wait_idle(env: dict, timeout: float = 60) -> None:
    """Wait until every node is ``idle`` in ``sinfo``. A node the controller marked not responding (``idle*``,
    or ``down*`` after ``SlurmdTimeout``: its link was cut for a while) is asked to register again with
    ``scontrol reconfigure``; left alone it waits for the controller's next ping of non-responding nodes (about
    90 s measured), and a job submitted meanwhile runs without it.

    Raises:
        AssertionError: a node is not idle after ``timeout`` seconds (sinfo's lines in the message).
    """
    deadline, nudged = time.monotonic() + timeout, False
    while True:
        states = node_states(env)
        if states and all(state == "idle" for state in states.values()):
            return
        assert time.monotonic() < deadline, f"nodes not idle after {timeout} s: {states}"
        if not nudged and any(state.endswith("*") for state in states.values()):
            subprocess.run(["scontrol", "reconfigure"], env=env, capture_output=True, timeout=30)
            nudged = True
        time.sleep(0.5)


def _until(check, timeout: float, message: str, root: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                             for p in sorted((root / "log").glob("*.log")))
            raise RuntimeError(f"{message}\n{logs}")
        time.sleep(0.3)
