"""Host plumbing for the local Slurm cluster: processes by id, the registry of running clusters, our
block in /etc/hosts, network namespaces, and the teardown that removes all of a cluster's traces."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

from common import fs

RUN_DIR = Path("/run/slipway-slurm")  # registry of running clusters (tmpfs: gone on reboot)
HOSTS = Path("/etc/hosts")
NETNS_DIR = Path("/run/netns")


class ClusterError(RuntimeError):
    """The local cluster could not be started, reached or stopped."""


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of `pid`, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    return rest[0], int(rest[19])


def alive(pid: int, start: int | None = None) -> bool:
    """True while `pid` runs and (if `start` is given) is still the process we started."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our own zombie
    st = proc_stat(pid)
    return st is not None and st[0] != "Z" and (start is None or st[1] == start)


def no_core_dumps() -> None:
    """A daemon's `preexec_fn`: no core file when it aborts (a slurmd of Debian's Slurm 22.05 has
    aborted in glibc's heap check and left a core dump in its working directory). The soft limit
    only: slurmd, as root, still gives jobs the limits their submitter had."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


def stop(procs: list[tuple[int, int | None]], grace: float = 10.0) -> None:
    """SIGTERM each (pid, start), SIGKILL those still running after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        live = [(p, s) for p, s in procs if alive(p, s)]
        for pid, _ in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            time.sleep(0.05)
            live = [(p, s) for p, s in live if alive(p, s)]
        if not live:
            return


def pids_in_netns(ns: str) -> list[int]:
    try:
        ref = os.stat(NETNS_DIR / ns)
    except FileNotFoundError:
        return []
    return _pids(lambda pid: os.path.samestat(os.stat(f"/proc/{pid}/ns/net"), ref))


def pids_mentioning(text: str) -> list[int]:
    """Processes whose command line contains `text` (a state dir path is unique to one cluster)."""
    return _pids(lambda pid: text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes())


def _pids(matches) -> list[int]:
    """The live processes but this one for which `matches(pid)` holds (one gone meanwhile: not)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if matches(entry) and alive(int(entry)):
                    found.append(int(entry))
    return found


def registry_path(name: str) -> Path:
    return RUN_DIR / f"{name}.json"


def read_registry(name: str) -> dict | None:
    return fs.read_json(registry_path(name))


def write_atomic(path: Path, text: str) -> None:
    """common.fs's atomic write, or a write in place where the rename is refused (/etc/hosts
    bind-mounted into a container)."""
    try:
        fs.write_atomic(path, text)
    except OSError as e:
        if e.errno not in (errno.EBUSY, errno.EXDEV, errno.EPERM):
            raise
        path.write_text(text)


@contextlib.contextmanager
def locked() -> Iterator[None]:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(RUN_DIR / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def hosts_markers(name: str) -> tuple[str, str]:
    return (f"# >>> slipway-slurm {name} (slipway cluster; removed by `down`) >>>",
            f"# <<< slipway-slurm {name} <<<")


def outside_block(text: str, name: str) -> list[str]:
    """The lines of /etc/hosts `text` outside cluster `name`'s block."""
    begin, end = hosts_markers(name)
    outside, inblock = [], False
    for line in text.splitlines():
        if line == begin:
            inblock = True
        elif line == end and inblock:
            inblock = False
        elif not inblock:
            outside.append(line)
    return outside


def set_hosts_block(name: str, lines: list[str]) -> None:
    """Replace (or with no lines remove) our block in /etc/hosts, atomically."""
    with locked():
        text = HOSTS.read_text()
        begin, end = hosts_markers(name)
        new_text = "\n".join(outside_block(text, name) + ([begin, *lines, end] if lines else [])) + "\n"
        if new_text != text:
            write_atomic(HOSTS, new_text)


def hosts_block_present(name: str) -> bool:
    return hosts_markers(name)[0] in HOSTS.read_text()


def run(*argv: str, check: bool = True, **options) -> subprocess.CompletedProcess:
    """`argv`'s output as text (`options` go to subprocess.run); a failure raised with its message."""
    res = subprocess.run(argv, capture_output=True, text=True, **options)
    if check and res.returncode != 0:
        raise ClusterError(f"`{shlex.join(argv)}` failed ({res.returncode}): "
                           f"{res.stderr.strip() or res.stdout.strip()}")
    return res


def our_netns(name: str) -> list[str]:
    out = run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{name}-")]


def our_links(name: str) -> list[str]:
    out = run("ip", "-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(f"{name}-")]


def check_subnet_free(subnet: str, name: str) -> None:
    """Refuse a /24 that an interface other than ours already uses."""
    for line in run("ip", "-o", "-4", "addr", "show").stdout.splitlines():
        dev, addr = line.split()[1], line.split()[3]
        if addr.startswith(f"{subnet}.") and not dev.startswith(f"{name}-"):
            raise ClusterError(f"{subnet}.0/24 is already used by {dev} ({addr}): "
                               "pick another /24 with --subnet")


def network_up(bridge: str, bridge_addr: str, nodes: list[tuple[str, str, str]]) -> None:
    """A bridge with `bridge_addr`/24 and, per (netns, veth, addr) in `nodes`, a network
    namespace whose eth0 (with addr/24) is a veth pair's end on the bridge; lo up."""
    run("ip", "link", "add", bridge, "type", "bridge")
    run("ip", "addr", "add", f"{bridge_addr}/24", "dev", bridge)
    run("ip", "link", "set", bridge, "up")
    for ns, veth, addr in nodes:
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        run("ip", "link", "set", veth, "master", bridge, "up")
        run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")


def teardown(name: str) -> list[tuple[int, int | None]]:
    """Stop everything cluster `name` left: its recorded processes, every process in its node namespaces
    (job steps), the namespaces, links, /etc/hosts block and registry entry; the (pid, start) it stopped."""
    procs = [(p["pid"], p["start"]) for p in (read_registry(name) or {}).get("processes", [])]
    stop(procs)
    for ns in our_netns(name):
        for _ in range(3):  # a dying slurmstepd may still fork: sweep until empty
            inside = pids_in_netns(ns)
            if not inside:
                break
            stop([(p, None) for p in inside], grace=0)
        run("ip", "netns", "del", ns, check=False)
    for link in our_links(name):  # veths go with their namespace; the bridge stays
        run("ip", "link", "del", link, check=False)
    set_hosts_block(name, [])
    with contextlib.suppress(FileNotFoundError):
        registry_path(name).unlink()
    return procs


def leftovers(name: str, state_dir: Path | None = None,
              procs: list[tuple[int, int | None]] = ()) -> list[str]:
    """What of cluster `name` is still there (empty once it is fully down)."""
    left = [f"process {p}" for p, s in procs if alive(p, s)]
    if state_dir is not None:
        left += [f"process {p} (mentions {state_dir})" for p in pids_mentioning(str(state_dir))]
    left += [f"netns {ns}" for ns in our_netns(name)]
    left += [f"link {link}" for link in our_links(name)]
    if hosts_block_present(name):
        left.append(f"{HOSTS} block of {name}")
    if registry_path(name).exists():
        left.append(f"registry {registry_path(name)}")
    return left
