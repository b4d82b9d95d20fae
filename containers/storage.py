"""Is podman's storage somewhere a build can work? (`slipway doctor`.) Overlay storage on a
network or parallel filesystem (NFS, Lustre, GPFS) fails obscurely or crawls; CSCS's recipe puts
graphroot and runroot on node-local /dev/shm and imports in the same allocation
(`image.build_on: compute`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from containers.pip_requirements import toml_loads

NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "fhgfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs",
              "panfs", "wekafs", "dvs", "afs", "9p", "fuse.sshfs", "fuse.glusterfs", "fuse.ceph", "fuse.gcsfuse",
              "fuse.s3fs", "fuse.rclone"}

CSCS_STORAGE_CONF = ('[storage]\\n  driver = "overlay"\\n  runroot = "/dev/shm/$USER/runroot"\\n'
                     '  graphroot = "/dev/shm/$USER/root"')


@dataclass
class Check:
    """One finding (`slipway doctor`, the build's warnings): `ok`, what was found, and the fix when not ok."""

    ok: bool
    what: str
    fix: Optional[str] = None


def storage_conf_path() -> tuple[Optional[Path], bool]:
    """The storage.conf podman reads, and whether it is the user's own (rootless)."""
    env = os.environ.get("CONTAINERS_STORAGE_CONF")
    if env:
        return Path(env), os.geteuid() != 0
    if os.geteuid() != 0:
        xdg = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        user = Path(xdg) / "containers" / "storage.conf"
        if user.is_file():
            return user, True
    for system in (Path("/etc/containers/storage.conf"), Path("/usr/share/containers/storage.conf")):
        if system.is_file():
            return system, False
    return None, False


def _mounts(mounts_file: Path) -> list[tuple[str, str]]:
    """(mount point, filesystem type), longest mount point first."""
    out = []
    for line in mounts_file.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3:
            point = parts[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            out.append((point, parts[2]))
    return sorted(out, key=lambda m: len(m[0]), reverse=True)


def filesystem_type(path: Path, mounts_file: Path = Path("/proc/self/mounts")) -> str:
    """The type of the filesystem that holds `path` (or would, once created)."""
    probe, rest = Path(os.path.abspath(path)), []
    while not probe.exists() and probe != probe.parent:  # a path not made yet: no mount point below here
        rest.insert(0, probe.name)
        probe = probe.parent
    real = os.path.join(os.path.realpath(probe), *rest)
    for point, fstype in _mounts(mounts_file):
        if real == point or real.startswith(point.rstrip("/") + "/"):
            return fstype
    return "unknown"


def check_storage_conf(path: Optional[Path] = None, mounts_file: Path = Path("/proc/self/mounts")) -> list[Check]:
    """Check podman's graphroot/runroot filesystems and driver; one `Check` per finding."""
    rootless = os.geteuid() != 0
    if path is None:
        path, rootless = storage_conf_path()
    storage: dict = {}
    checks: list[Check] = []
    if path is not None:
        try:
            storage = toml_loads(path.read_text()).get("storage", {})
        except (OSError, ValueError) as exc:  # TOMLDecodeError is a ValueError
            return [Check(False, f"podman storage.conf {path} unreadable ({exc})",
                          "fix its TOML or remove it to use podman's defaults")]
    where = str(path) if path else "podman defaults (no storage.conf)"
    if rootless and (path is None or "/etc/" in str(path) or "/usr/share/" in str(path)):
        data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        graphroot = storage.get("rootless_storage_path") or f"{data_home}/containers/storage"
        runroot = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    else:
        graphroot = storage.get("graphroot", "/var/lib/containers/storage")
        runroot = storage.get("runroot", "/run/containers/storage")
    fix = (f"put graphroot and runroot on node-local disk or /dev/shm in "
           f"{'~/.config/containers/storage.conf' if rootless else '/etc/containers/storage.conf'}, e.g. on "
           f"CSCS: {CSCS_STORAGE_CONF}, and build with image.build_on: compute")
    for key, value in (("graphroot", graphroot), ("runroot", runroot)):
        resolved = Path(os.path.expandvars(os.path.expanduser(value)))
        fstype = filesystem_type(resolved, mounts_file)
        bad = fstype in NETWORK_FS or (fstype.startswith("fuse.") and fstype != "fuse.fuse-overlayfs")
        checks.append(Check(not bad, f"podman {key} {resolved} is on {fstype} ({where})", fix if bad else None))
    driver = storage.get("driver", "overlay")
    checks.append(Check(driver == "overlay", f"podman storage driver is {driver!r} ({where})",
                        None if driver == "overlay" else
                        'set driver = "overlay" under [storage] (vfs copies every layer: slow and huge)'))
    return checks
