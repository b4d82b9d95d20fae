"""A second user on this machine, for what a teammate's files do to slipway: the tests run as root,
where permission bits do not bind, so a closed run directory is closed only to another uid.

`teammate()` makes the user once (useradd, where root allows) and a folder both users reach;
`Teammate.slipway(...)` runs `slipway` as that user (setpriv), with this checkout's code and the
venv's packages on its path (the venv's own interpreter may lie in a home the user cannot enter:
the system's Python of the same version runs it). Tests skip, saying why, where this cannot be.
"""

from __future__ import annotations

import os
import pwd
import shutil
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME = "slipwaymate"


@dataclass(frozen=True)
class Teammate:
    uid: int
    gid: int
    python: str
    shared: Path  # a folder both users reach (mode 0755, the test's)

    def env(self, **extra: str) -> dict[str, str]:
        paths = [str(ROOT), *site.getsitepackages()]
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.shared / "home"),
                "PYTHONPATH": os.pathsep.join(paths), "LANG": "C.UTF-8", "COLUMNS": "300", **extra}

    def slipway(self, *args: str, env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        """`slipway ARGS` as the teammate; a command that hangs fails the test at `timeout`."""
        argv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--",
                self.python, "-m", "jobs", *args]
        return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _system_python() -> str | None:
    """An interpreter of this one's version that another user may run (the venv's may not be)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for folder in ("/usr/bin", "/usr/local/bin", "/bin"):
        path = shutil.which(version, path=folder)
        if path:
            return path
    return None


@pytest.fixture
def teammate() -> Iterator[Teammate]:
    """The second user and a folder for the test's files (removed after), or skip saying why."""
    if os.geteuid() != 0:
        pytest.skip("a second user needs root to make and to run as (useradd, setpriv)")
    for tool in ("useradd", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (util-linux, passwd)")
    python = _system_python()
    if python is None:
        pytest.skip(f"no system python{sys.version_info.major}.{sys.version_info.minor} that another user may run")
    try:
        pw = pwd.getpwnam(NAME)
    except KeyError:
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
                              capture_output=True, text=True)
        try:  # another test process may have made it meanwhile
            pw = pwd.getpwnam(NAME)
        except KeyError:
            pytest.skip(f"cannot make a second user: {made.stderr.strip() or made.returncode}")
    shared = Path(tempfile.mkdtemp(prefix="slipway-teammate-"))  # pytest's own tmp folder is closed to others
    shared.chmod(0o755)
    (shared / "home").mkdir(mode=0o777)
    (shared / "home").chmod(0o777)
    probe = subprocess.run(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--",
                            python, "-c", "import jobs.cli, rich, yaml, plumbum"],
                           env=Teammate(pw.pw_uid, pw.pw_gid, python, shared).env(), cwd=shared,
                           capture_output=True, text=True)
    if probe.returncode != 0:
        shutil.rmtree(shared, ignore_errors=True)
        pytest.skip(f"the second user cannot run this checkout's slipway: {probe.stderr.strip()[-300:]}")
    try:
        yield Teammate(pw.pw_uid, pw.pw_gid, python, shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
