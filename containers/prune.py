"""`slipway image prune`: old squashfs files, their records, logs and podman
tags, leftovers of interrupted builds, and the stopped `enroot.*` podman
containers that enroot's `podman://` import leaves (see containers.tools.Enroot),
which keep their image in use so that removing its tag fails. What cannot be
removed is reported, one line each, and makes the command exit non-zero.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from containers.context import project_root, resolve_path
from containers.image import ImageConfig, human, image_plan, resolve_image, stale_temps
from containers.tools import Enroot, Podman, ToolError
from common.errors import ConfigError

_IMAGE_FILE = r"{name}-(?P<h>[0-9a-f]{{12}})\.sqsh"


@dataclass
class PruneResult:
    removed: list[Path] = field(default_factory=list)  # files and directories
    containers: list[str] = field(default_factory=list)  # enroot's leftover podman containers
    tags: list[str] = field(default_factory=list)  # podman tags
    failed: list[str] = field(default_factory=list)  # one line each: what stayed, and why
    kept: dict[Path, str] = field(default_factory=dict)  # squashfs -> why it stayed

    @property
    def ok(self) -> bool:
        return not self.failed


class _Report:
    def __init__(self, console: Console, result: PruneResult):
        self.console, self.result = console, result

    def done(self, what: str) -> None:
        self.console.print(f"removed {what}", highlight=False, markup=False)

    def failed(self, what: str) -> None:
        self.result.failed.append(what)
        self.console.print(f"[yellow]could not remove[/] {escape(what)}", highlight=False)


def _remove_path(path: Path, result: PruneResult, report: _Report, label: str | None = None) -> bool:
    try:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        report.failed(f"{path}: {exc.strerror or exc}")
        return False
    result.removed.append(path)
    report.done(label or str(path))
    return True


def _prune_import_leftovers(podman: Podman, name: str, result: PruneResult, report: _Report) -> None:
    """Stopped `enroot.*` containers made from any of this image's tags. One whose enroot
    work dir still exists belongs to an import that may be running: left alone."""
    try:
        containers = podman.containers(Enroot.CONTAINER_FILTER)
    except ToolError as exc:
        report.failed(f"enroot's leftover podman containers: cannot list them ({exc})")
        return
    for c in containers:
        if not c.image.startswith(f"localhost/{name}:"):
            continue
        what = f"podman container {c.name} (left by enroot import of {c.image})"
        workdir = Enroot.temp_dir() / c.name
        if c.state in ("running", "paused"):
            report.failed(f"{what}: it is {c.state}; `podman rm -f {c.name}` if nothing uses it")
        elif workdir.exists():
            report.failed(f"{what}: enroot's work dir {workdir} exists, so an import may still be running; "
                          "prune again once it is done (or remove that dir if no import runs)")
        elif outcome := podman.remove_container(c.id):
            result.containers.append(c.name)
            report.done(what)
        else:
            report.failed(f"{what}: podman rm {outcome.why}")


def prune_images(cfg: ImageConfig, keep: int = 1, *, pinned: dict[Path, list[str]], root: Path | None = None,
                 remove: list[str] | None = None, console: Console | None = None) -> PruneResult:
    """Remove all but the current image, the images runs pin, and the newest others, up to
    `keep` squashfs files besides the pinned ones, with their records, logs and podman tags;
    enroot's leftover containers of any of this image's tags; stale build leftovers.
    `pinned`: each squashfs (resolved) runs pin, with their names (jobs.runs.pinned_images).
    `remove`: squashfs files to remove although runs pin them (never the current one)."""
    if keep < 1:
        raise ConfigError("--keep", f"must be >= 1 (the current image is always kept), got {keep}")
    console = console or Console()
    result = PruneResult()
    report = _Report(console, result)
    root = (root or project_root()).resolve()
    out = resolve_path(root, cfg.image.output_dir)
    name = cfg.image.name
    pattern = re.compile(_IMAGE_FILE.format(name=re.escape(name)))
    images = sorted((p for p in out.glob(f"{name}-*.sqsh") if pattern.fullmatch(p.name) and not p.is_symlink()),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    current = resolve_image(cfg, root=root)
    forced: set[Path] = set()
    for given in remove or []:
        path = Path(os.path.realpath(resolve_path(Path.cwd(), given)))
        if not any(p.resolve() == path for p in images):
            raise ConfigError("--remove", f"{given} is not one of the {name}-HASH.sqsh images in {out}: give the "
                                          "path of one (`ls` it), or the config whose images they are")
        if current and path == current:
            raise ConfigError("--remove", f"{given} is the current image ({name}.sqsh): build another first, or "
                                          "remove it by hand")
        forced.add(path)
    pins = pinned
    kept = [p for p in images if current and p.resolve() == current]
    result.kept.update({p: "the current image" for p in kept})
    for p in images:
        runs = pins.get(p.resolve())
        if runs and p.resolve() not in forced:
            shown = ", ".join(runs[:8]) + (f" and {len(runs) - 8} more" if len(runs) > 8 else "")
            why = f"pinned by run{'s' if len(runs) > 1 else ''} {shown}"
            result.kept[p] = f"{result.kept[p]}, {why}" if p in result.kept else why
            if p not in kept:
                kept.append(p)
    has_current = any(current and p.resolve() == current for p in images)
    # --keep counts the current image and the newest others; pinned ones are kept besides.
    newest = [p for p in images if p not in kept and p.resolve() not in forced][: keep - has_current]
    result.kept.update({p: f"among the newest (--keep {keep})" for p in newest})
    kept += newest
    for img in kept:
        console.print(f"kept {img}: {result.kept[img]}", highlight=False, markup=False, soft_wrap=True)
    for img in images:
        if img in kept:
            continue
        h12 = pattern.fullmatch(img.name).group("h")
        size = img.stat().st_size
        if _remove_path(img, result, report, f"{img} ({human(size)})"):
            for path in (out / f"{name}-{h12}.json", out / "logs" / f"{name}-{h12}.log"):
                _remove_path(path, result, report)
    # Leftovers of interrupted builds and imports.
    old = time.time() - 86400
    leftovers = [p for p in [*out.glob(".context-*"), *out.glob(".build-*.yaml")] if p.stat().st_mtime < old]
    for leftover in leftovers + stale_temps(out, f".{name}-*.sqsh.tmp-*"):
        _remove_path(leftover, result, report)
    if Podman.available():
        podman = Podman.find()
        # First the containers: while one exists, podman refuses to remove its image's tag.
        _prune_import_leftovers(podman, name, result, report)
        # Pinned images' tags too (in `kept`): a pinned run's image can be reimported from its tag.
        keep_tags = {f"localhost/{name}:{pattern.fullmatch(p.name).group('h')}" for p in kept}
        try:
            keep_tags.add(image_plan(cfg, root=root, enroot_mount=False, git=False).tag)
        except (ConfigError, ToolError):
            pass
        for tag in podman.tags(f"localhost/{name}"):
            if tag in keep_tags:
                continue
            if outcome := podman.untag(tag):
                result.tags.append(tag)
                report.done(f"podman tag {tag}")
            else:
                report.failed(f"podman tag {tag}: podman rmi {outcome.why}")
        if result.tags:
            console.print("podman keeps their unshared layers as build cache: `podman image prune` frees them",
                          highlight=False, markup=False)
    if not (result.removed or result.containers or result.tags or result.failed):
        console.print(f"nothing to prune: {len(kept)} image(s) kept in {out}", highlight=False, markup=False)
    return result
