"""One wrapper per external tool the image build and the code snapshot drive: podman, enroot, git.

Command lines are built by pure functions (`*_argv`) that tests read, and run through plumbum. Tools
are looked up on `os.environ`'s PATH at call time (`shutil.which`, not plumbum's snapshot of it) and
children get a copy of `os.environ`, so a test can put a stand-in first on PATH.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from shutil import which
from typing import Callable, Optional, Sequence

from plumbum import local
from plumbum.commands.processes import ProcessExecutionError

from common.errors import failure_line

PODMAN_URL = "https://podman.io/docs/installation"


class ToolError(RuntimeError):
    """An external tool is missing or failed; the message says what to do next."""


def _capture(argv: list[str]) -> tuple[int, str]:
    """Run a short command; return (exit code, its non-empty output lines, stdout and stderr)."""
    lines: list[str] = []
    return stream(argv, lines.append), "\n".join(lines)


def stream(argv: list[str], on_line: Callable[[str], None], *, env: dict[str, str] | None = None,
           cwd: Path | None = None, quiet: Optional[tuple[float, Callable[[float], None]]] = None) -> int:
    """Hand each output line (stdout and stderr, split on newlines and carriage returns) to `on_line`;
    the exit code. Ctrl-C stops the child before re-raising. `quiet` (SECONDS, CALL): CALL(seconds
    since the start) after each SECONDS without output, so a long silent stretch shows it is alive."""
    cmd = local[argv[0]][argv[1:]]
    proc = cmd.popen(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                     cwd=str(cwd) if cwd else None)
    try:
        assert proc.stdout is not None
        buf = b""
        start = last = time.monotonic()
        while True:
            if quiet is not None:
                if not select.select([proc.stdout], [], [], max(0.0, quiet[0] - (time.monotonic() - last)))[0]:
                    last = time.monotonic()
                    quiet[1](last - start)
                    continue
            chunk = proc.stdout.read1(65536)
            if not chunk:
                break
            last = time.monotonic()
            buf += chunk
            *lines, buf = re.split(rb"\r\n|\r|\n", buf)
            for line in lines:
                if line.strip():
                    on_line(line.decode(errors="replace"))
        if buf.strip():
            on_line(buf.decode(errors="replace"))
        return proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


@dataclass
class Podman:
    exe: str = "podman"

    @staticmethod
    def available() -> bool:
        return which("podman") is not None

    @classmethod
    def find(cls) -> "Podman":
        path = which("podman")
        if path is None:
            raise ToolError(f"podman not found on PATH: install podman ({PODMAN_URL}) or build on a node that has "
                            "it (image.build_on: compute runs the build through srun on a compute node)")
        return cls(path)

    @staticmethod
    def build_argv(*, tag: str, dockerfile: Path, context: Path, build_args: dict[str, str],
                   labels: dict[str, str] | None = None, network_host: bool = False, isolation: str | None = None,
                   no_cache: bool = False) -> list[str]:
        argv = ["podman", "build", "-f", str(dockerfile), "-t", tag]
        for key, value in build_args.items():
            argv += ["--build-arg", f"{key}={value}"]
        # Labels go on in a last step of their own: every cached layer before it stays usable.
        for key, value in (labels or {}).items():
            argv += ["--label", f"{key}={value}"]
        if network_host:
            argv.append("--network=host")
        if isolation:
            argv.append(f"--isolation={isolation}")
        if no_cache:
            argv.append("--no-cache")
        return argv + [str(context)]

    def image_exists(self, tag: str) -> bool:
        return _capture([self.exe, "image", "exists", tag])[0] == 0

    def _inspect(self, tag: str, template: str) -> str:
        """`podman image inspect --format TEMPLATE` of `tag`; "" where it fails."""
        rc, out = _capture([self.exe, "image", "inspect", "--format", template, tag])
        return out if rc == 0 else ""

    def image_size(self, tag: str) -> int | None:
        """Uncompressed size in bytes (what enroot unpacks before squashing)."""
        out = self._inspect(tag, "{{.Size}}").strip()
        return int(out) if out.isdigit() else None

    def image_id(self, tag: str) -> str | None:
        return self._inspect(tag, "{{.Id}}").strip() or None

    def image_env(self, tag: str) -> dict[str, str]:
        """The image's ENV (its base's included: NGC's CUDA_VERSION); {} when it cannot be read."""
        out = self._inspect(tag, "{{range .Config.Env}}{{println .}}{{end}}")
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def _rows(self, *argv: str) -> list:
        """The rows `podman ARGV` (a listing with `--format json`) prints; a ToolError where it fails."""
        rc, out = _capture([self.exe, *argv])
        if rc != 0:
            raise ToolError(f"podman {argv[0]} failed (exit {rc}): {failure_line(out)}")
        try:
            return json.loads(out or "[]") or []
        except ValueError:
            raise ToolError(f"podman {argv[0]} --format json printed something else: {failure_line(out)}") from None

    def tags(self, repository: str) -> dict[str, dict[str, str]]:
        """`localhost/NAME:TAG` references of one repository, each with its image's labels."""
        found: dict[str, dict[str, str]] = {}
        for row in self._rows("images", "--format", "json", "--filter", f"reference={repository}"):
            labels = row.get("Labels") or {}
            for name in row.get("Names") or []:
                if isinstance(name, str) and name.startswith(repository + ":"):
                    found[name] = {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}
        return dict(sorted(found.items()))

    def untag(self, tag: str) -> Optional[str]:
        """Remove one tag (its layers go with the last); why it failed (a container of it, even stopped), or None."""
        return _failure(*_capture([self.exe, "rmi", tag]))

    def containers(self, name_regex: str) -> list["Container"]:
        """All containers (any state) whose name matches `name_regex` (podman's own filter)."""
        return [Container.from_ps(row) for row in self._rows("ps", "--all", "--format", "json", "--filter",
                                                              f"name={name_regex}")]

    def remove_container(self, ident: str) -> Optional[str]:
        """`podman rm -v` (anonymous volumes too), never --force: a running one stays; why it failed, or None."""
        return _failure(*_capture([self.exe, "rm", "-v", ident]))


def _failure(rc: int, out: str) -> Optional[str]:
    return None if rc == 0 else f"exit {rc}: {failure_line(out)}"


@dataclass(frozen=True)
class Container:
    """One row of `podman ps --all --format json`."""

    id: str
    name: str
    image: str  # the reference it was created from, e.g. localhost/slipway:0123456789ab
    image_id: str
    state: str  # created, exited, running, ...
    labels: dict = field(default_factory=dict)  # its image's labels, which podman gives the containers made from it

    @classmethod
    def from_ps(cls, row: dict) -> "Container":
        names, labels = row.get("Names") or [""], row.get("Labels")
        return cls(id=str(row.get("Id", "")), name=str(names[0]), image=str(row.get("Image", "")),
                   image_id=str(row.get("ImageID", "")), state=str(row.get("State", "")).lower(),
                   labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {})


# CSCS's enroot lists `-x, --... mount` among import's options; upstream has no -x.
_MOUNT_OPTION = re.compile(r"^\s*-x\b", re.MULTILINE)


@dataclass
class Enroot:
    exe: str = "enroot"

    # `enroot import podman://IMAGE` (src/docker.sh) makes a work dir with `mktemp -d -p $ENROOT_TEMP_PATH
    # enroot.XXXXXXXXXX`, runs `podman create --name` with that dir's name (printing the container id),
    # exports it, and on exit removes the dir and calls `docker rm -f -v NAME`. Without a working docker that
    # fails (enroot then exits non-zero under `set -e`) and the stopped container stays, keeping the image in
    # use: slipway removes it itself.
    CONTAINER_FILTER = r"^enroot\.[A-Za-z0-9]+$"

    @classmethod
    def find(cls) -> "Enroot | None":
        path = which("enroot")
        return cls(path) if path else None

    def version(self) -> str:
        rc, out = _capture([self.exe, "version"])
        return out.strip() if rc == 0 else "unknown"

    def supports_mount(self) -> bool:
        """Whether `enroot import -x mount` exists (CSCS's build; not upstream)."""
        return bool(_MOUNT_OPTION.search(_capture([self.exe, "import", "--help"])[1]))

    @staticmethod
    def import_argv(*, output: Path, uri: str, mount: bool) -> list[str]:
        return ["enroot", "import", *(["-x", "mount"] if mount else []), "-o", str(output), uri]

    @staticmethod
    def temp_dir() -> Path:
        """Where enroot unpacks the image before squashing it."""
        return Path(os.environ.get("ENROOT_TEMP_PATH") or os.environ.get("TMPDIR") or "/tmp")


def squashfs_ok(path: Path) -> bool:
    """A whole squashfs file: its directory table (at the end) lists."""
    tool = which("unsquashfs")
    if tool is None:
        return path.is_file() and path.stat().st_size > 0
    return _capture([tool, "-l", str(path)])[0] == 0


def git(root: Path, *args: str) -> Optional[str]:
    """`git -C ROOT ARGS...`'s output; None where git is missing or fails (outside a checkout)."""
    exe = which("git")
    try:
        return local[exe]("-C", str(root), *args) if exe else None
    except (ProcessExecutionError, OSError, ValueError):
        return None


def git_state(root: Path, paths: Sequence[Path] = ()) -> dict:
    """The commit of the checkout at `root` and whether it is dirty (a tracked file differs from the
    commit: of `paths` only, when given), or nulls outside git. Untracked files are no part of
    what a snapshot or an image copies (containers/sources.py), so they make nothing dirty."""
    which_paths = ["--", *(os.path.relpath(p, root) for p in paths)] if paths else []
    commit, status = git(root, "rev-parse", "HEAD"), git(root, "status", "--porcelain", "--untracked-files=no",
                                                        *which_paths)
    if commit is None or status is None:
        return {"commit": None, "dirty": None}
    return {"commit": commit.strip(), "dirty": bool(status.strip())}
