"""What a local cluster is (ClusterSpec), the slurm.conf it runs on, and the spec of the one that is up.

Accounting is off (Debian's build has no ``none`` plugins for accounting storage or job
completion, and slurmctld dies on them): ``sacct`` does not work; ``squeue`` and ``scontrol show
job`` do, and a finished job stays visible to them for MinJobAge (300 s).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from pathlib import Path

from common.errors import ConfigError
from jobs.devcluster.host import ClusterError, read_registry

CONF_HEADER = "# Written by `slipway cluster up` for a local test cluster; rewritten on every `up`."
# The checkout whose slipway runs (the folder holding this `jobs` package): the registry records
# which one started a cluster, as every checkout on the machine names its cluster `slpw` by default.
CHECKOUT = Path(__file__).resolve().parents[2]


def is_local_conf(path: str | os.PathLike) -> bool:
    """Whether `path` is a slurm.conf `slipway cluster up` wrote (it stays after `down`)."""
    try:
        with open(path, errors="replace") as f:
            return f.readline().rstrip("\n") == CONF_HEADER
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """What to start. The defaults are the cluster tests and `make` targets use."""

    state_dir: Path
    nodes: int = 2
    cpus: int = 4  # per node; more than the machine's cores is fine (config_overrides)
    memory_mb: int = 2048  # per node; not enforced (CR_Core, task/none)
    name: str = "slpw"  # prefix of namespaces, links, the /etc/hosts block, the registry
    node_prefix: str = "node"
    ctl_host: str = "slipway-ctl"
    subnet: str = "10.213.0"  # a /24: .1 is the controller (the bridge), .(10+K) node K
    ctld_port: int = 6917
    slurmd_port: int = 6918
    partition: str = "debug"
    plugstack: Path | None = None  # a SPANK plugstack.conf for every node, e.g. one that loads pyxis
    # Directories each node sees a copy of its own (a real node's local /run, /tmp ...), bound from
    # STATE_DIR/nodes/NODE/N in the slurmd's own mount namespace: per-node state (enroot's, pyxis's)
    # of two "nodes" on one machine does not collide.
    node_private: tuple[str, ...] = ()
    # Seconds a job credential lives (AuthInfo cred_expire; Slurm's default, its minimum 5). A requeued
    # job may not start again before it has passed: tests that requeue lower it.
    cred_expire: int = 120
    # slurm.conf MaxArraySize (Slurm's default): small values let a test split a sweep over arrays.
    max_array_size: int = 1001
    # slurm.conf FirstJobId: two clusters up at once (the tests' session one and the pyxis tier's)
    # then never give the same job id, which names a job's processes and containers on the machine.
    first_job_id: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", Path(self.state_dir).absolute())
        if not 1 <= self.nodes <= 200:
            raise ConfigError("--nodes", f"{self.nodes}: choose 1 to 200 (addresses .11-.210 of the /24)")
        if not 1 <= self.cpus <= 4096:
            raise ConfigError("--cpus", f"{self.cpus}: give the CPUs each node declares, 1 to 4096")
        for flag, port in (("--ctld-port", self.ctld_port), ("--slurmd-port", self.slurmd_port)):
            if not 1 <= port <= 65535 or (flag == "--slurmd-port" and port == self.ctld_port):
                raise ConfigError(flag, f"{port}: give a TCP port, 1 to 65535, the controller's and the nodes' apart")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", self.name):
            raise ConfigError("--name", f"{self.name!r}: use 1-8 lowercase letters and digits, a letter first "
                                        "(it prefixes interface names, which are capped at 15 characters)")
        if not re.fullmatch(r"(25[0-5]|2[0-4]\d|1?\d?\d)(\.(25[0-5]|2[0-4]\d|1?\d?\d)){2}", self.subnet):
            raise ConfigError("--subnet", f"{self.subnet!r}: give the first three octets of a /24, e.g. 10.213.0")
        for host in (self.node_prefix, self.ctl_host):
            if not re.fullmatch(r"[a-z][a-z0-9-]*", host):
                raise ClusterError(f"host name {host!r}: use lowercase letters, digits and '-'")
        # slurm.conf has no quoting: a path with blanks, '#' or '=' would be cut there.
        if re.search(r"[\s#=\"'\\]", str(self.state_dir)):
            raise ConfigError("--state-dir", f"{str(self.state_dir)!r} holds a character slurm.conf cannot "
                                             "carry (blank, #, =, quote, backslash): pick a plain path")
        object.__setattr__(self, "node_private", tuple(self.node_private))
        if not 1 <= self.max_array_size <= 4_000_001:
            raise ConfigError("--max-array-size", f"{self.max_array_size}: Slurm takes 1 to 4000001")
        if self.cred_expire < 5:
            raise ClusterError(f"cred_expire={self.cred_expire}: Slurm takes 5 s or more")
        for d in self.node_private:
            if not d.startswith("/") or re.search(r"[\s'\"\\]", d):
                raise ConfigError("--node-private", f"{d!r}: give absolute paths without blanks or quotes")
        if self.plugstack is not None:
            object.__setattr__(self, "plugstack", Path(self.plugstack).absolute())
            if not self.plugstack.is_file() or re.search(r"[\s#=\"'\\]", str(self.plugstack)):
                raise ConfigError("--plugstack", f"{self.plugstack}: give an existing file whose path slurm.conf "
                                                 "can carry (no blanks, #, =, quotes)")
        # slurmstepd makes a socket per step in the spool dir: SPOOL/NODE/NODE_JOBID.STEPID (108 bytes at most).
        step_socket = self.state_dir / "spool" / self.node_names[-1] / f"{self.node_names[-1]}_4294967291.4294967291"
        if len(str(step_socket)) > 107:
            raise ConfigError("--state-dir", f"{self.state_dir} is too long for slurmstepd's step sockets "
                                             f"({len(str(step_socket))} > 107 bytes): pick a shorter one")
        if len(str(self.munge_socket)) > 100:
            raise ConfigError("--state-dir", f"{self.state_dir} is too long for a unix socket path "
                                             f"({self.munge_socket}): pick a shorter one")

    # names and addresses
    @property
    def node_names(self) -> list[str]:
        return [f"{self.node_prefix}{k}" for k in range(1, self.nodes + 1)]

    @property
    def ctl_addr(self) -> str:
        return f"{self.subnet}.1"

    def node_addr(self, k: int) -> str:
        return f"{self.subnet}.{10 + k}"

    def netns(self, k: int) -> str:
        return f"{self.name}-{self.node_prefix}{k}"

    def veth(self, k: int) -> str:
        return f"{self.name}-v{k}"

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    # files, all in the state dir
    conf = property(lambda self: self.state_dir / "slurm.conf")
    munge_socket = property(lambda self: self.state_dir / "munge" / "munge.socket")
    munge_key = property(lambda self: self.state_dir / "munge" / "munge.key")
    log_dir = property(lambda self: self.state_dir / "log")

    def hosts_lines(self) -> list[str]:
        """Each name with its address, also in the IPv4-mapped IPv6 form (::ffff:a.b.c.d): torch's
        TCPStore listens dual-stack and names each peer by getnameinfo on such an address, which
        /etc/hosts' IPv4 lines do not answer; the lookup then goes to DNS, which the node
        namespaces cannot reach (EAI_AGAIN, seconds lost and a c10d warning per connection)."""
        named = [(self.ctl_addr, self.ctl_host)] + [(self.node_addr(k), n) for k, n in enumerate(self.node_names, 1)]
        return [f"{addr}\t{name}" for addr, name in named] + [f"::ffff:{addr}\t{name}" for addr, name in named]


def render_slurm_conf(spec: ClusterSpec) -> str:
    """slurm.conf for `spec`: the settings lab.md found working, short timeouts for fast tests."""
    s = spec.state_dir
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={n} NodeAddr={spec.node_addr(k)} CPUs={spec.cpus} "
        f"RealMemory={spec.memory_mb} State=UNKNOWN"
        for k, n in enumerate(spec.node_names, 1))
    return f"""\
{CONF_HEADER}
ClusterName=slipway
SlurmctldHost={spec.ctl_host}({spec.ctl_addr})
SlurmctldPort={spec.ctld_port}
SlurmdPort={spec.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Our own munged, so a system munged (and its key) is left alone.
AuthInfo=socket={spec.munge_socket},cred_expire={spec.cred_expire}
StateSaveLocation={s}/ctld
SlurmdSpoolDir={s}/spool/%n
SlurmctldPidFile={s}/run/slurmctld.pid
SlurmdPidFile={s}/run/slurmd-%n.pid
SlurmctldLogFile={s}/log/slurmctld.log
SlurmdLogFile={s}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: processes are tracked by parentage, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Trust the CPUs/RealMemory below even where the machine has fewer.
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
JobRequeue=1
KillOnBadExit=1
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=30
MessageTimeout=10
# A connection gets 10 s, not Slurm's 2: the nodes share one machine with image builds and test
# suites, where a step's launch on a node can wait on a connection longer than 2 s.
TCPTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=300
MaxArraySize={spec.max_array_size}
FirstJobId={spec.first_job_id}
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
# Accounting is off: AccountingStorageType and JobCompType are left out (Debian's
# build lacks their none plugins). sacct does not work; squeue and scontrol do.
{nodes}
PartitionName={spec.partition} Nodes={",".join(spec.node_names)} Default=YES MaxTime=INFINITE State=UP
""" + (f"PlugStackConfig={spec.plugstack}\n" if spec.plugstack else "")


def default_state_dir(purpose: str = "") -> Path:
    """/tmp/slipway-slurm-UID (the command line's), /tmp/slipway-slurm-UID-PURPOSE for others."""
    return Path(tempfile.gettempdir()) / "-".join(filter(None, ["slipway-slurm", str(os.getuid()), purpose]))


def started_elsewhere(name: str = "slpw") -> str | None:
    """A line saying that the cluster `name` that is up is not this checkout's (or unrecorded), else None."""
    reg = read_registry(name)
    if not reg:
        return None
    checkout = reg.get("checkout")
    if checkout == str(CHECKOUT):
        return None
    whose = (f"by another checkout ({checkout})" if isinstance(checkout, str) and checkout
             else "by a slipway that did not record its checkout")
    return (f"cluster {name!r} was started {whose}, not this one ({CHECKOUT}): its jobs run that checkout's "
            f"daemons and settings and it may stop them any time; slipway cluster up --name NAME starts one of "
            f"this checkout's")


def spec_of_running(name: str = "slpw") -> ClusterSpec | None:
    """The spec of the cluster `name` that is up (as recorded by its `up`), None if none is."""
    reg = read_registry(name)
    if not reg or not isinstance(reg.get("spec"), dict):
        return None
    # A key another slipway's `up` recorded (a newer one's setting) is not this one's to read:
    # the cluster is up all the same, and every command that asks about it keeps working.
    known = {f.name for f in dataclasses.fields(ClusterSpec)}
    return ClusterSpec(**{k: v for k, v in reg["spec"].items() if k in known})

