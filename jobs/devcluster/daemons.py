"""The local cluster's daemons (munged, slurmctld, a slurmd per node), started, watched and stopped
by process id, and the Slurm client commands pointed at them.

Each node is a slurmd in its own network namespace (a veth on a bridge, an address from a private
/24, its name in /etc/hosts) and UTS namespace (hostname ``nodeK``): a multi-node job sees distinct
hosts, as torchrun's c10d rendezvous (it compares the endpoint with the local hostname) and gloo
(it resolves the hostname) need. Everything the cluster writes lives in one state dir; its
processes are recorded in /run/slipway-slurm/NAME.json and stopped by those ids, never by name; a
later ``up`` first tears down whatever an earlier one under the same NAME left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from jobs.devcluster.host import (HOSTS, NETNS_DIR, ClusterError, alive, check_subnet_free, leftovers, locked,
                               network_up, no_core_dumps, our_links, our_netns, outside_block, proc_stat,
                               read_registry, registry_path, run as host_run, set_hosts_block, teardown, write_atomic)
from jobs.devcluster.spec import CHECKOUT, ClusterSpec, render_slurm_conf

STATE_MARKER = ".slipway-slurm"  # a state dir `up` may wipe carries this file
DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "squeue", "scontrol")
TOOLS = ("ip", "nsenter", "unshare", "hostname")


def unavailable_reason() -> str | None:
    """Why a local cluster cannot start here (None if it can): for skips."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (network namespaces, /etc/hosts)"
    if missing := [b for b in DAEMONS + TOOLS if shutil.which(b) is None]:
        return (f"missing {', '.join(missing)}: install Debian's slurm-wlm, munge, iproute2, "
                "util-linux to run the local Slurm cluster")
    return None


class LocalSlurmCluster:
    """A munged, a slurmctld and `spec.nodes` slurmds, each node in its own namespaces."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self._children: list[subprocess.Popen] = []

    def env(self) -> dict[str, str]:
        """Environment for sbatch/squeue/scontrol/scancel/srun to reach this cluster."""
        return {"SLURM_CONF": str(self.spec.conf)}

    def run(self, *argv: str, cwd: Path | None = None, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        return host_run(*argv, check=check, cwd=cwd, timeout=timeout, env={**os.environ, **self.env()})

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-p", self.spec.partition, "-o", "%N %T",
                       check=False, timeout=15).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def log_tails(self, lines: int = 25) -> str:
        """The last `lines` of each daemon's log, for an error that says why the cluster failed."""
        names = ["munged.out", "slurmctld.log", "slurmctld.out",
                 *(f"slurmd-{n}.{kind}" for n in self.spec.node_names for kind in ("log", "out"))]
        logs = [self.spec.log_dir / name for name in names]
        return "\n".join(f"--- {p}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                         for p in logs if p.exists())

    def up(self, timeout: float = 60) -> "LocalSlurmCluster":
        """Start the cluster (leftovers under the same name torn down first); return once every node is idle."""
        spec = self.spec
        if reason := unavailable_reason():
            raise ClusterError(reason)
        old = read_registry(spec.name)
        if old or our_netns(spec.name) or our_links(spec.name):
            print(f"slipway cluster: tearing down an earlier cluster {spec.name!r} "
                  f"({(old or {}).get('state_dir', 'unrecorded')}, started from "
                  f"{(old or {}).get('checkout') or 'an unrecorded checkout'})", file=sys.stderr)
        teardown(spec.name)
        self._check_hosts_free()
        check_subnet_free(spec.subnet, spec.name)
        self._prepare_state_dir()
        self._record([])  # from here on a crash leaves something teardown() finds
        try:
            network_up(spec.bridge, spec.ctl_addr,
                       [(spec.netns(k), spec.veth(k), spec.node_addr(k)) for k in range(1, spec.nodes + 1)])
            set_hosts_block(spec.name, spec.hosts_lines())
            self._start_munged()
            self._start("slurmctld", self._in_uts(spec.ctl_host, "slurmctld", "-D", "-f", str(spec.conf)),
                        "slurmctld.out")
            for node in spec.node_names:
                self.start_node(node)
            self._wait_ready(timeout)
        except BaseException as e:
            tails = self.log_tails()
            self.down(check=False)  # logs stay in the state dir
            if isinstance(e, ClusterError):
                raise ClusterError(f"{e}\nlogs in {spec.log_dir}:\n{tails}") from None
            raise
        return self

    def down(self, check: bool = True) -> None:
        """`teardown`, and this process's children reaped; logs stay. With `check`, raise if anything is left."""
        procs = teardown(self.spec.name)
        procs += [(p.pid, None) for p in self._children]
        for p in self._children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=1)
        self._children.clear()
        if check and (left := leftovers(self.spec.name, self.spec.state_dir, procs)):
            raise ClusterError(f"cluster {self.spec.name} is not fully down: {', '.join(left)}")

    def status(self) -> dict:
        reg = read_registry(self.spec.name)
        if reg is None:
            return {"name": self.spec.name, "up": False}
        procs = [{"role": p["role"], "pid": p["pid"], "alive": alive(p["pid"], p["start"])}
                 for p in reg["processes"]]
        ctld = any(p["alive"] for p in procs if p["role"] == "slurmctld")
        return {"name": self.spec.name, "up": bool(procs) and all(p["alive"] for p in procs),
                "state_dir": reg["state_dir"], "checkout": reg.get("checkout"),
                "env": self.env(), "processes": procs, "nodes": self.node_states() if ctld else {}}

    def start_node(self, node: str) -> None:
        """Start `node`'s slurmd in its node's namespaces; again where the one started before has
        exited (its node returns to service as it registers: ReturnToService=2)."""
        spec = self.spec
        for child in self._children:
            child.poll()  # reap an exited one
        binds = [(spec.state_dir / "nodes" / node / str(i), Path(d)) for i, d in enumerate(spec.node_private)]
        argv = ["nsenter", f"--net={NETNS_DIR / spec.netns(spec.node_names.index(node) + 1)}",
                *self._in_uts(node, "slurmd", "-D", "-N", node, "-f", str(spec.conf), binds=binds)]
        self._start(f"slurmd {node}", argv, f"slurmd-{node}.out")

    def _prepare_state_dir(self) -> None:
        s = self.spec.state_dir
        if s.exists() and any(s.iterdir()) and not (s / STATE_MARKER).exists():
            raise ClusterError(f"state dir {s} is not empty and was not made by slipway cluster up: "
                               "point --state-dir at a new or empty directory")
        # nodes/: each node's private dirs (enroot's data, pyxis's runtime). A new cluster numbers
        # its jobs from 1 again, so an earlier cluster's containers there would pass for this one's.
        for sub in ("ctld", "spool", "run", "log", "nodes"):
            shutil.rmtree(s / sub, ignore_errors=True)
        for sub in ("ctld", "run", "log", *(f"spool/{n}" for n in self.spec.node_names)):
            (s / sub).mkdir(parents=True, exist_ok=True)
        (s / STATE_MARKER).touch()
        munge = s / "munge"
        munge.mkdir(exist_ok=True)
        munge.chmod(0o755)  # munged wants its socket dir searchable by all, writable by none
        if not self.spec.munge_key.exists():  # our own key: /etc/munge is never touched
            fd = os.open(self.spec.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(128))
        self.spec.conf.write_text(render_slurm_conf(self.spec))
        with contextlib.suppress(KeyError, ImportError):  # the default munged location, for munge tools
            import pwd
            pw = pwd.getpwnam("munge")
            Path("/run/munge").mkdir(mode=0o755, exist_ok=True)
            os.chown("/run/munge", pw.pw_uid, pw.pw_gid)

    def _check_hosts_free(self) -> None:
        ours = {line.split()[1] for line in self.spec.hosts_lines()}
        outside = outside_block(HOSTS.read_text(), self.spec.name)
        if taken := sorted({n for line in outside for n in line.split("#")[0].split()[1:] if n in ours}):
            raise ClusterError(f"{HOSTS} already maps {', '.join(taken)} outside this cluster's block "
                               "(another cluster, or a real host): bring that down or change the names")

    @staticmethod
    def _in_uts(hostname: str, *argv: str, binds: list[tuple[Path, Path]] = ()) -> list[str]:
        """argv run in a new UTS namespace whose hostname is `hostname` (exec keeps the pid);
        with `binds` also in a private mount namespace where each (source, target) is bound."""
        setup = [f"hostname {shlex.quote(hostname)}"]
        for src, target in binds:
            setup += [f"mkdir -p {shlex.quote(str(src))} {shlex.quote(str(target))}",
                      f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(target))}"]
        unshare = ["unshare", "--uts", *(["--mount", "--propagation", "private"] if binds else []), "--"]
        return [*unshare, "sh", "-c", f"{' && '.join(setup)} && exec {shlex.join(argv)}"]

    def _record(self, processes: list[dict]) -> None:
        with locked():
            write_atomic(registry_path(self.spec.name), json.dumps(
                {"state_dir": str(self.spec.state_dir), "conf": str(self.spec.conf), "checkout": str(CHECKOUT),
                 "spec": {**dataclasses.asdict(self.spec), "state_dir": str(self.spec.state_dir),
                          "plugstack": str(self.spec.plugstack) if self.spec.plugstack else None},
                 "processes": processes}, indent=1))

    def _start(self, role: str, argv: list[str], log: str) -> subprocess.Popen:
        with open(self.spec.log_dir / log, "ab") as out:
            # Run in the state dir, never the caller's (a repository): whatever a daemon leaves
            # in its working directory is the cluster's, wiped by the next `up`.
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={**os.environ, **self.env()},
                                    cwd=self.spec.state_dir / "run", preexec_fn=no_core_dumps)
        self._children.append(proc)
        st = proc_stat(proc.pid)
        reg = read_registry(self.spec.name) or {"processes": []}  # a restarted role's entry replaced
        self._record([p for p in reg["processes"] if p["role"] != role]
                     + [{"role": role, "pid": proc.pid, "start": st[1] if st else None, "argv": argv}])
        return proc

    def _start_munged(self) -> None:
        s = self.spec
        proc = self._start("munged", [
            # --force: a pytest tmp dir sits under a 0700 dir, which munged would refuse
            # for its socket; every client here is root, so it can still connect.
            "munged", "--foreground", "--force", f"--socket={s.munge_socket}", f"--key-file={s.munge_key}",
            f"--pid-file={s.state_dir / 'run' / 'munged.pid'}", f"--log-file={s.log_dir / 'munged.log'}",
            f"--seed-file={s.state_dir / 'munge' / 'munged.seed'}"], "munged.out")
        deadline = time.monotonic() + 10
        while not s.munge_socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"munged did not create {s.munge_socket}")
            time.sleep(0.05)

    def _wait_ready(self, timeout: float) -> None:
        s = self.spec
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        ctld_up = False
        while time.monotonic() < deadline:
            if dead := [p.args for p in self._children if p.poll() is not None]:
                raise ClusterError(f"a daemon exited during start: {shlex.join(dead[0])}")
            if not ctld_up:  # sinfo is slow to give up on a controller that is not listening yet
                with contextlib.suppress(OSError), socket.create_connection((s.ctl_addr, s.ctld_port), 0.5):
                    ctld_up = True
            if ctld_up:
                states = self.node_states()
                if sorted(states) == sorted(self.spec.node_names) and set(states.values()) == {"idle"}:
                    return
            time.sleep(0.2)
        raise ClusterError(f"nodes not idle after {timeout:.0f} s (controller "
                           f"{'listening' if ctld_up else 'not listening'}; sinfo: {states or 'nothing'})")
