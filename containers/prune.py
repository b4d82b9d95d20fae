"""`slipway image prune` (docs/image.md#old-images): this project's old squashfs files, their
records, logs and podman tags, leftovers of interrupted builds, and the stopped `enroot.*`
containers enroot's `podman://` import leaves (containers.tools.Enroot). Only this project's
(containers/project.py), and none whose build or import holds its tag's lock; what is kept is
said with why; what cannot be removed is reported, one line each, and makes it exit non-zero.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.markup import escape

from containers.context import project_root, resolve_path
from containers.image import ImageConfig, human, image_plan, resolve_image
from containers.importer import stale_temps
from containers.project import LABEL, PATH_LABEL, Project
from containers.record import BuildRecord
from containers.tools import Container, Enroot, Podman, ToolError
from common.errors import ConfigError

_IMAGE_FILE = r"{name}-(?P<h>[0-9a-f]{{12}})\.sqsh"


@dataclass
class PruneResult:
    """What a prune removed (dry run: would remove), kept and left alone, each said on `console`."""

    removed: list[Path] = field(default_factory=list)  # files and directories
    containers: list[str] = field(default_factory=list)  # enroot's leftover podman containers
    tags: list[str] = field(default_factory=list)  # podman tags
    failed: list[str] = field(default_factory=list)  # one line each: what stayed, and why
    kept: dict[Path, str] = field(default_factory=dict)  # squashfs -> why it stayed
    kept_tags: dict[str, str] = field(default_factory=dict)  # podman tag -> why it stayed
    left_alone: list[str] = field(default_factory=list)  # what is not this project's, one line per kind
    dry_run: bool = False
    console: Console = field(default_factory=Console, repr=False)

    @property
    def ok(self) -> bool:
        return not self.failed

    def say(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def done(self, what: str) -> None:
        self.say(f"{'would remove' if self.dry_run else 'removed'} {what}")

    def fail(self, what: str) -> None:
        self.failed.append(what)
        self.console.print(f"[yellow]could not remove[/] {escape(what)}", highlight=False, soft_wrap=True)

    def leave(self, what: str, names: list[str]) -> None:
        if names:
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            self.left_alone.append(f"left alone {len(names)} {what}: {shown}")
            self.say(self.left_alone[-1])

    def remove(self, path: Path, label: str | None = None) -> bool:
        if not path.exists() and not path.is_symlink():
            return False
        if not self.dry_run:
            try:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            except FileNotFoundError:
                return False
            except OSError as exc:
                self.fail(f"{path}: {exc.strerror or exc}")
                return False
        self.removed.append(path)
        self.done(label or str(path))
        return True


def _owner(squashfs: Path, project: Optional[Project], out: Path, root: Path) -> tuple[Optional[str], Optional[str]]:
    """(this squashfs's tag, why it is not this project's or None)."""
    record = BuildRecord.read(squashfs.with_suffix(".json"))
    tag = record.tag if record else None
    if record and record.project:
        return tag, None if project and record.project == project.id else "another project's"
    inside = out.resolve() == root.resolve() or root.resolve() in out.resolve().parents
    return tag, None if inside else "with no project in its record, outside this checkout"


def prune_images(cfg: ImageConfig, keep: int = 1, *, pinned: dict[Path, list[str]], root: Path | None = None,
                 remove: list[str] | None = None, console: Console | None = None,
                 dry_run: bool = False) -> PruneResult:
    """Prune all but the current image, those runs pin and the newest others, `keep` in all besides
    the pinned. `pinned`: squashfs (resolved) -> the runs that pin it (jobs.runs.pinned_images);
    `remove`: squashfs files to remove although runs pin them (never the current one)."""
    if keep < 1:
        raise ConfigError("--keep", f"must be >= 1 (the current image is always kept), got {keep}")
    result = PruneResult(dry_run=dry_run, console=console or Console())
    root = (root or project_root()).resolve()
    out, name = resolve_path(root, cfg.image.output_dir), cfg.image.name
    try:
        project: Optional[Project] = Project.of(root)
    except ConfigError as exc:
        project = None
        result.say(f"no podman image or container is this project's: {exc}")
    pattern = re.compile(_IMAGE_FILE.format(name=re.escape(name)))
    found = [p for p in out.glob(f"{name}-*.sqsh") if pattern.fullmatch(p.name) and not p.is_symlink()]
    owners = {p: _owner(p, project, out, root) for p in found}
    result.leave(f"squashfs files in {out} that are not this project's (their records name another project) or "
                 "whose project is not known", [f"{p.name} ({owners[p][1]})" for p in sorted(found) if owners[p][1]])
    images = sorted((p for p in found if not owners[p][1]), key=lambda p: p.stat().st_mtime, reverse=True)
    _choose(cfg, images, keep, pinned, remove or [], result, out, root)
    for img in images:
        if img not in result.kept:
            h12 = pattern.fullmatch(img.name).group("h")
            if result.remove(img, f"{img} ({human(img.stat().st_size)})"):
                for path in (out / f"{name}-{h12}.json", out / "logs" / f"{name}-{h12}.log"):
                    result.remove(path)
    # Leftovers of interrupted builds and imports.
    old = time.time() - 86400
    leftovers = [p for p in [*out.glob(".context-*"), *out.glob(".build-*.yaml")] if p.stat().st_mtime < old]
    for leftover in leftovers + stale_temps(out, f".{name}-*.sqsh.tmp-*"):
        result.remove(leftover)
    if Podman.available():
        # A kept squashfs keeps its tag (a pinned run's image can be imported again from it), and
        # so does what this config builds now.
        keep_tags = {owners[p][0]: f"the tag of {p.name}, kept" for p in result.kept if owners[p][0]}
        with contextlib.suppress(ConfigError, ToolError):
            keep_tags.setdefault(image_plan(cfg, root=root, enroot_mount=False, git=False).tag,
                                 "what this config builds now")
        _prune_podman(Podman.find(), name, project, keep_tags, result)
    if not (result.removed or result.containers or result.tags or result.failed):
        result.say(f"nothing to prune: {len(result.kept)} image(s) kept in {out}")
    elif dry_run:
        result.say("dry run: nothing was removed (run it again without --dry-run to remove the above)")
    return result


def _choose(cfg: ImageConfig, images: list[Path], keep: int, pinned: dict[Path, list[str]], remove: list[str],
            result: PruneResult, out: Path, root: Path) -> None:
    """Which of this project's `images` (newest first) stay, each with why, into `result.kept`."""
    current, name = resolve_image(cfg, root=root), cfg.image.name
    forced: set[Path] = set()
    for given in remove:
        path = Path(os.path.realpath(resolve_path(Path.cwd(), given)))
        if not any(p.resolve() == path for p in images):
            raise ConfigError("--remove", f"{given} is not one of this project's {name}-HASH.sqsh images in {out}: "
                                          "give the path of one (`ls` it), or the config whose images they are")
        if current and path == current:
            raise ConfigError("--remove", f"{given} is the current image ({name}.sqsh): build another first, or "
                                          "remove it by hand")
        forced.add(path)
    kept = result.kept
    kept.update({p: "the current image" for p in images if current and p.resolve() == current})
    has_current = bool(kept)
    for p in images:
        runs = pinned.get(p.resolve())
        if runs and p.resolve() not in forced:
            shown = ", ".join(runs[:8]) + (f" and {len(runs) - 8} more" if len(runs) > 8 else "")
            why = f"pinned by run{'s' if len(runs) > 1 else ''} {shown}"
            kept[p] = f"{kept[p]}, {why}" if p in kept else why
    # --keep counts the current image and the newest others; pinned ones are kept besides.
    newest = [p for p in images if p not in kept and p.resolve() not in forced][: keep - has_current]
    kept.update({p: f"among the newest (--keep {keep})" for p in newest})
    for img, why in kept.items():
        result.say(f"kept {img}: {why}")


def _prune_podman(podman: Podman, name: str, project: Optional[Project], keep_tags: dict[str, str],
                  result: PruneResult) -> None:
    """This project's tags of `name` not in `keep_tags` and `enroot.*` containers; the rest left alone."""
    repository = f"localhost/{name}"
    try:
        tags = podman.tags(repository)
        containers = podman.containers(Enroot.CONTAINER_FILTER)
    except ToolError as exc:
        result.fail(f"podman tags and enroot's leftover containers: cannot list them ({exc})")
        return
    ours = re.compile(rf"{re.escape(repository)}:[0-9a-f]{{12}}-{project.token}") if project else None

    def mine(labels: dict) -> bool:
        return project is not None and labels.get(LABEL) == project.id

    other = [f"{t} ({labels.get(PATH_LABEL) or 'another project'})" for t, labels in tags.items()
             if labels.get(LABEL) and not mine(labels)]
    result.leave(f"podman tags of {repository} that are another project's", other)
    result.leave(f"podman tags of {repository} with no project label (not built by this slipway, or before it "
                 "labelled its images: `podman rmi` them by hand if they are yours)",
                 [t for t, labels in tags.items() if not labels.get(LABEL)])
    candidates = [t for t, labels in tags.items() if mine(labels) and ours and ours.fullmatch(t)]
    result.leave("podman tags with this project's label but a name slipway does not give (yours: left as they "
                 "are)", [t for t, labels in tags.items() if mine(labels) and t not in candidates])
    leftovers: dict[str, list[Container]] = {}
    for c in containers:
        if mine(c.labels):
            leftovers.setdefault(c.image, []).append(c)
    result.leave("enroot import containers of other projects' or unlabelled images",
                 [f"{c.name} ({c.image})" for c in containers if not mine(c.labels)])
    if project is not None:
        for tag in sorted(set(candidates) | set(leftovers)):
            _prune_tag(podman, project, tag, leftovers.get(tag, []), keep_tags if tag in candidates else None,
                       result)


def _prune_tag(podman: Podman, project: Project, tag: str, leftovers: list[Container],
               keep_tags: Optional[dict[str, str]], result: PruneResult) -> None:
    """`tag`'s leftover containers, then the tag itself unless `keep_tags` names it (None: the tag is
    not one to remove), while no build or import of it runs."""
    with project.idle(tag) as idle:
        busy = (None if idle else "a build or import of it is running now" if idle is False else
                f"whether a build of it runs cannot be told ({project.lock_path(tag).parent} has no flock)")
        # First the containers: while one exists, podman refuses to remove its image's tag.
        for c in leftovers:
            what = f"podman container {c.name} (left by enroot import of {tag})"
            if busy:
                result.say(f"kept {what}: {busy}")
            elif c.state in ("running", "paused"):
                result.fail(f"{what}: it is {c.state}; `podman rm -f {c.name}` if nothing uses it")
            elif result.dry_run or (failed := podman.remove_container(c.id)) is None:
                result.containers.append(c.name)
                result.done(what)
            else:
                result.fail(f"{what}: podman rm {failed}")
        if keep_tags is None:
            return
        why = busy or keep_tags.get(tag)  # kept while a build runs, or when asked to
        if why:
            result.kept_tags[tag] = why
            result.say(f"kept podman tag {tag}: {why}")
        elif result.dry_run or (failed := podman.untag(tag)) is None:
            result.tags.append(tag)
            result.done(f"podman tag {tag}")
            if not result.dry_run:
                project.forget(tag)
        else:
            result.fail(f"podman tag {tag}: podman rmi {failed}")
