"""enroot's import of a built podman image into a squashfs, and what it leaves behind.

The squashfs is written under a temporary name (`.NAME-HASH12.sqsh.tmp-HOST-PID`) and renamed
into place only once whole. Upstream enroot's `podman://` import leaves a stopped `enroot.*`
podman container (see containers.tools.Enroot), which keeps the image in use: the import removes
its own at once, never another import's; containers/prune.py removes older ones of this project.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from collections import deque
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from common.environ import as_typed
from common.errors import human
from common.fs import pid_alive
from containers.plan import ImagePlan
from containers.tools import Enroot, Podman, ToolError, squashfs_ok, stream

# enroot unpacks the image (its uncompressed size) before squashing it to about half.
SQUASH_RATIO = 0.5


def host_name() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"


def check_free_space(*, image_size: int, output_dir: Path, temp_dir: Path | None) -> None:
    """Room for the squashfs and, unless enroot mounts the image (`-x mount`), the unpacked image."""
    needs: dict[int, list] = {}
    for path, need, what in ((output_dir, int(image_size * SQUASH_RATIO), "the squashfs"),
                             (temp_dir, image_size, "the image unpacked by enroot")):
        if path is None:
            continue
        probe = path
        while not probe.exists():
            probe = probe.parent
        entry = needs.setdefault(probe.stat().st_dev, [probe, 0, []])
        entry[1] += need
        entry[2].append(f"{what} in {path}")
    for probe, need, whats in needs.values():
        free = shutil.disk_usage(probe).free
        if free < need:
            raise ToolError(f"not enough disk for enroot import: ~{human(need)} needed for {' and '.join(whats)}, "
                            f"{human(free)} free: free space, set ENROOT_TEMP_PATH to a larger local disk, or "
                            "change image.output_dir")


def stale_temps(output_dir: Path, glob: str) -> list[Path]:
    """Leftovers of interrupted imports: this host's whose process is gone, or another host's older than a day."""
    host, stale = host_name(), []
    for tmp in output_dir.glob(glob):
        tmp_host, _, pid = tmp.name.rsplit(".tmp-", 1)[-1].rpartition("-")
        if tmp_host == host and pid.isdigit():
            alive = int(pid) != os.getpid() and pid_alive(int(pid))
        else:
            alive = time.time() - tmp.stat().st_mtime < 86400
        if not alive:
            stale.append(tmp)
    return stale


_CONTAINER_ID = re.compile(r"\b[0-9a-f]{64}\b")


def _clean_import(plan: ImagePlan, podman: Podman, before: set[str] | None, printed: set[str],
                  console: Console) -> tuple[list[str], list[str]]:
    """Remove the stopped `enroot.*` containers this import left (see Enroot): (removed names, warnings).
    Only those new since the import began, made from our tag and, where enroot printed container ids
    (`podman create` does), one of those: never another import's or another image's."""
    if before is None:
        return [], []
    try:
        bare = (podman.image_id(plan.tag) or "").removeprefix("sha256:")
        leftovers = [c for c in podman.containers(Enroot.CONTAINER_FILTER)
                     if c.id not in before and c.state not in ("running", "paused")
                     and (c.image == plan.tag or bool(bare) and c.image_id.removeprefix("sha256:") == bare)
                     and (c.id in printed or not printed)]
    except ToolError as exc:
        return [], [f"could not look for enroot's leftover podman container: {exc}"]
    removed, warnings = [], []
    for c in leftovers:
        if (failed := podman.remove_container(c.id)) is None:
            removed.append(c.name)
        else:
            warnings.append(f"could not remove enroot's leftover podman container {c.name} ({failed}): it keeps "
                            f"{plan.tag} in use; `slipway image prune` retries")
    for warning in warnings:  # on one line, its suggestion as this shell runs slipway: pasted whole
        console.print(f"[yellow]warning:[/] {escape(as_typed(warning))}", highlight=False, soft_wrap=True)
    return removed, warnings


def enroot_import(plan: ImagePlan, enroot: Enroot, podman: Podman, console: Console) -> list[str]:
    size = podman.image_size(plan.tag)
    if size:
        check_free_space(image_size=size, output_dir=plan.output_dir,
                         temp_dir=None if plan.enroot_mount else Enroot.temp_dir())
    for stale in stale_temps(plan.output_dir, f".{plan.squashfs.name}.tmp-*"):
        stale.unlink(missing_ok=True)
    tmp = plan.temp_squashfs
    tmp.unlink(missing_ok=True)
    tail = deque(maxlen=40)
    try:  # what exists before, so the cleanup after can tell this import's container from others
        before: set[str] | None = {c.id for c in podman.containers(Enroot.CONTAINER_FILTER)}
    except ToolError as exc:
        before = None
        console.print(f"[yellow]warning:[/] {escape(str(exc))}: enroot's leftover container will not be removed")
    printed: set[str] = set()  # container ids in enroot's output (`podman create` prints the id)
    console.print(f"[bold]enroot import[/] {'-x mount ' if plan.enroot_mount else ''}podman://{plan.tag}"
                  f"  (ENROOT_SQUASH_OPTIONS={escape(repr(plan.squash_options))}"
                  f"{', image ' + human(size) if size else ''})", highlight=False)
    try:
        try:
            with plan.log.open("a") as log, console.status("enroot import") as status:
                log.write("$ " + " ".join(f"{k}={v!r}" for k, v in plan.enroot_env.items()) + " "
                          + " ".join(plan.enroot_argv) + "\n")

                def on_line(line: str) -> None:
                    log.write(line + "\n")
                    tail.append(line)
                    printed.update(_CONTAINER_ID.findall(line))
                    status.update(f"enroot import: {escape(line[:100])}")

                rc = stream([enroot.exe, *plan.enroot_argv[1:]], on_line, env=plan.enroot_env)
        finally:  # also after a failed or interrupted import: the container stays either way
            removed, warnings = _clean_import(plan, podman, before, printed, console)
            notes = [f"removed enroot's leftover podman container {name}" for name in removed] + warnings
        if rc != 0:
            # enroot can exit non-zero after a complete write: upstream's cleanup runs `docker rm` (fails
            # without docker), CSCS's has its own errors. Keep the file only if its tables read back whole.
            if tmp.is_file() and squashfs_ok(tmp):
                why = " (its cleanup calls `docker rm`; slipway removed the container itself)" if removed else ""
                notes.append(f"enroot exited {rc} but the squashfs reads back whole: kept{why}")
                console.print(f"[yellow]note:[/] {escape(notes[-1])}", highlight=False)
            else:
                if any("no space left on device" in line.lower() for line in tail):
                    raise ToolError(f"enroot import ran out of disk: free space in {plan.output_dir} and "
                                    f"{Enroot.temp_dir()} (ENROOT_TEMP_PATH); log: {plan.log}")
                last = tail[-1].strip()[:300] if tail else ""
                raise ToolError(f"enroot import failed (exit {rc}): {last}; the podman image {plan.tag} is built, "
                                f"rerun to retry the import; log: {plan.log}")
        if not tmp.is_file():
            raise ToolError(f"enroot import exited {rc} without writing {tmp}; log: {plan.log}")
        os.replace(tmp, plan.squashfs)
    finally:
        tmp.unlink(missing_ok=True)
    return notes
