"""The image a run pins: `container.image` (or, when empty, what `make image` built for this config)
resolved once at submission to one content-addressed squashfs file, whose absolute path goes into
the EDF or pyxis flags and whose build hash, tag, size and mtime into the manifest (`ImagePin`): a
later `make image` cannot change what a submitted run uses. Also the build of the config's settings
(`build_of_settings`, `build_differences`) and the pyxis container kept on the nodes (`kept_build`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from common.errors import ConfigError, shown
from common.fs import file_sha256, read_json, user_cache, write_atomic
from common.rundir import CodeSnapshot
from common.schema import require
from containers.context import UNHASHED_ARGS, build_root, resolve_path
from containers.image import ImagePlan, image_plan
from containers.project import Project
from containers.record import BuildRecord
from edf import Environment, expand_host, is_local_image, resolve_base
from jobs.config import Config
from jobs.slurm.script import Pins


SOURCES = ("build", "file", "registry", "base_environment", "none")
DIGESTS_KEPT = 64  # squashfs files whose digest the user's cache remembers


@dataclass(frozen=True)
class ImagePin:
    """The image a run uses, resolved once at submission."""

    reference: str = ""  # what the config said ("" = what `make image` built)
    image: str = ""  # what the EDF / pyxis flags name: an absolute squashfs path or a registry reference
    source: str = ""  # "build" (make image's record), "file", "registry", "base_environment" or "none"
    path: Optional[str] = None  # the squashfs file
    size: Optional[int] = None
    mtime: Optional[str] = None
    build_hash: Optional[str] = None  # slipway's content hash of the build inputs (names the file)
    tag: Optional[str] = None  # the podman tag it was built as
    sha256: Optional[str] = None  # of the file's bytes, for a squashfs slipway did not build

    def record(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def check(self, where: str) -> None:
        """A pin as a manifest records it (common/schema.py calls this as it reads one)."""
        require(self.source in SOURCES, f"{where}.source", lambda: f"{shown(self.source)} is not one of {', '.join(SOURCES)}")

    def pins(self, code: Optional[CodeSnapshot], build: Optional[str], project: Optional[str] = None) -> Pins:
        """What a job of this image checks on every node: the squashfs by its size, mtime and (where
        known) bytes; `code`, the kept container's build key and the project ride along."""
        mtime = None
        if self.mtime:
            with contextlib.suppress(ValueError):
                mtime = int(datetime.fromisoformat(self.mtime).timestamp())
        return Pins(code=code, image_file=self.path, image_sha256=self.sha256, image_size=self.size,
                    image_mtime=mtime, image_identity=self.identity if self.path else None, build=build,
                    project=project)

    @property
    def identity(self) -> Optional[str]:
        """What tells two images apart: the build hash, the bytes' hash, or the reference."""
        return self.build_hash or self.sha256 or (self.image or None)


def _file_pin(reference: str, path: Path, source: str, known: Optional[BuildRecord] = None) -> ImagePin:
    real = path.resolve()
    st = real.stat()
    mtime = datetime.fromtimestamp(st.st_mtime, timezone.utc).isoformat(timespec="seconds")
    record = known or BuildRecord.beside(real)
    if record:
        return ImagePin(reference, str(real), source, str(real), st.st_size, mtime, record.hash, record.tag)
    # A squashfs slipway did not build: its bytes are its identity.
    return ImagePin(reference, str(real), source, str(real), st.st_size, mtime, sha256=_bytes_digest(real, st))


def _bytes_digest(real: Path, st: os.stat_result) -> str:
    """The sha256 of squashfs `real`'s bytes, read once per version of the file, not at each launch
    of a dev loop: cached under what any write changes (device, inode, size, mtime and ctime: a user
    cannot set ctime back, as the nodes' size-and-mtime check assumes they will not)."""
    cache = user_cache("image-digests.json")
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns} {real}"
    known = {k: v for k, v in (read_json(cache, limit=1 << 20) or {}).items()
             if isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v)}
    if key in known:
        return known[key]
    digest = file_sha256(real)
    others = [(k, v) for k, v in known.items() if k.split(" ", 1)[-1] != str(real)][-DIGESTS_KEPT + 1:]
    with contextlib.suppress(OSError):  # unwritable: the next launch reads the bytes again
        write_atomic(cache, json.dumps(dict([*others, (key, digest)]), indent=1) + "\n", sync=False)
    return digest


def pin_image(cfg: Config, project_dir: Path, notes: Optional[list[str]] = None) -> ImagePin:
    """The image `cfg` runs, pinned; a one-line error when there is none (other news to `notes`)."""
    c = cfg.container
    if not c.in_container:
        return ImagePin("", "", "none")
    if c.image:
        if not is_local_image(c.image):
            return ImagePin(c.image, c.image, "registry")
        path = project_dir / expand_host(c.image, "container.image")  # an absolute path replaces project_dir
        if not path.is_file():
            raise ConfigError("container.image", f"squashfs {c.image} ({path}) does not exist: run `make image "
                                                 f"CONFIG={cfg.config_name}` (it prints the path), or set container.image")
        return _file_pin(c.image, path, "file")
    if c.base_environment:
        base = resolve_base(replace(c, image="", base_environment=list(c.base_environment)))
        if base.image:
            if is_local_image(base.image):
                field = base_field(c, lambda env: env.image == base.image)
                path = project_dir / expand_host(base.image, field)
                if not path.is_file():
                    # Not a registry name: the job would fail on the nodes, after queueing.
                    raise ConfigError(field, f"the base environment's image, squashfs {base.image}, does not exist "
                                             "on this node: build or copy it there, fix that EDF's image, or set "
                                             "container.image")
                return _file_pin("", path, "base_environment")
            return ImagePin("", base.image, "base_environment")
    record = build_of_settings(cfg, project_dir, notes)
    return _file_pin("", Path(record.squashfs), "build", record)


def builds(cfg: Config, root: Path) -> list[BuildRecord]:
    """Every image `make image` built from checkout `root` for the config's image name whose
    squashfs is there, newest first (OUTPUT_DIR/NAME-HASH12.json beside OUTPUT_DIR/NAME-HASH12.sqsh)."""
    out_dir = resolve_path(root, cfg.image.output_dir)
    found = []
    for sidecar in out_dir.glob(f"{cfg.image.name}-*.json") if out_dir.is_dir() else ():
        record = BuildRecord.read(sidecar)
        if record is not None and record.name == cfg.image.name and Path(record.squashfs).is_file() \
                and Path(record.squashfs).resolve() == sidecar.with_suffix(".sqsh").resolve():
            found.append((record.built_at, sidecar.stat().st_mtime_ns, record))
    return [record for *_, record in sorted(found, key=lambda x: x[:2], reverse=True)]


def build_of_settings(cfg: Config, project_dir: Path, notes: Optional[list[str]] = None) -> BuildRecord:
    """The build a submission of `cfg` runs: the newest with the config's image settings (the same
    hash; with a code snapshot, one differing in code alone), so that image variants each run their
    own; with none, one line naming what differs from the closest build and the command that builds
    it. Where the settings cannot be worked out (no Dockerfile: an install without its sources), the
    newest build, noted in `notes`."""
    root = build_root(project_dir, cfg.image.dockerfile)
    found = builds(cfg, root)
    if not found:
        raise ConfigError("container.image", f"is not set and no image is built for this config: run "
                                             f"`{image_build_command(cfg)}` first (make image CONFIG={cfg.config_name} "
                                             "without overrides), or set container.image to a squashfs path or a "
                                             "registry image")
    try:
        plan = image_plan(cfg, root=root, enroot_mount=False, git=False)
    except ConfigError as exc:
        if notes is not None:
            notes.append(f"runs the newest build, {found[0].hash12}: which build has this config's image settings "
                         f"cannot be worked out here ({exc})")
        return found[0]
    exact = [r for r in found if r.hash == plan.hash]
    if exact:
        return exact[0]
    if cfg.code.snapshot:
        same = [r for r in found if not build_differences(r, plan, code_snapshot=True)]
        if same:
            return same[0]
    closest, differs = min(((r, build_differences(r, plan, code_snapshot=cfg.code.snapshot)) for r in found),
                           key=lambda pair: len(pair[1]))  # the newest of the closest, as min keeps the first
    raise ConfigError("container.image", f"no image is built for this config's image settings (the closest build, "
                                         f"{closest.hash12}, differs: {'; '.join(differs)}): "
                                         f"`{image_build_command(cfg)}` builds it")


def base_field(env: Environment, has: Callable[[Environment], bool]) -> str:
    """`container.base_environment[i]` for the base EDF that gives the merged value `has` tests
    (later bases win, as in `resolve_base`), or the list itself when no single one does."""
    for i in reversed(range(len(env.base_environment))):
        try:
            one = resolve_base(replace(env, image="", mounts=[], base_environment=[env.base_environment[i]]))
        except ConfigError:  # a base that only checks out merged with the others: not the one asked for
            continue
        if has(one):
            return f"container.base_environment[{i}]"
    return "container.base_environment"


# Build args as the config sets them (what `image_plan` derives each from), for messages.
_BUILD_ARG_FIELDS = {"BASE_IMAGE": "image.base_image", "FLASH_ATTN": "image.flash_attn",
                     "WHEELHOUSE": "image.wheelhouse", "WHEELHOUSE_DIGEST": "the wheelhouse's files",
                     "SLIPWAY_VERSION": "slipway's version (pyproject.toml)",
                     "EXTRAS": "train.float8 (the float8 extra)", "NUMACTL": "launch.preset (numactl)"}


def _shown_arg(key: str, value: Optional[str]) -> str:
    if key == "FLASH_ATTN" and value in ("0", "1"):
        return "true" if value == "1" else "false"
    if key == "WHEELHOUSE":
        return "set" if value else "unset"
    return repr(value) if value is not None else "unset"


def build_differences(record: Optional[BuildRecord], plan: ImagePlan, *, code_snapshot: bool = False) -> list[str]:
    """What differs between a build `record` (None: gone) and the one `plan` would make, one phrase each
    in the config's terms; empty when the hashes agree or, with `code_snapshot`, when only sources
    but pyproject.toml differ (the job never runs the image's copy of them: no rebuild needed)."""
    if record is not None and record.hash == plan.hash:
        return []
    if record is None or record.build_args is None:
        return ["what differs is not known: the build's record is gone"]
    out: list[str] = []
    old, new = record.build_args, plan.build_args
    for key in sorted((set(old) | set(new)) - set(UNHASHED_ARGS)):
        if old.get(key) != new.get(key):
            what = _BUILD_ARG_FIELDS.get(key, f"image.build_args.{key}")
            out.append(f"{what} changed" if key == "WHEELHOUSE_DIGEST" else
                       f"{what} {_shown_arg(key, old.get(key))} -> {_shown_arg(key, new.get(key))}")
    if (record.squash_options or plan.squash_options) != plan.squash_options:
        out.append(f"image.squash_options {record.squash_options!r} -> {plan.squash_options!r}")
    inputs = record.inputs
    if inputs is not None:
        if inputs.get("dockerfile") != plan.inputs.get("dockerfile"):
            out.append("the Dockerfile (image.dockerfile) changed")
        old_src, new_src = inputs.get("sources") or {}, plan.inputs.get("sources") or {}
        changed = [part for part in sorted(set(old_src) | set(new_src))
                   if part != "wheels/" and old_src.get(part) != new_src.get(part)]
        if "pyproject.toml" in changed:
            out.append("the dependencies (pyproject.toml) changed")
        code = [part for part in changed if part != "pyproject.toml"]
        if code and not code_snapshot:
            out.append(f"sources changed in {', '.join(code)}")
        if code_snapshot and not out:
            return []
    elif not out:
        out.append("the sources or the Dockerfile changed (this build's record predates slipway recording "
                   "its inputs, so which one is not known)")
    return out or ["the build inputs differ (hash only)"]


def image_build_command(cfg: Config) -> str:
    """`slipway image build` with the user's CONFIG and image.* overrides: all (with the checkout) a build reads."""
    words = shlex.split(cfg.given_args) if cfg.given_args else [cfg.config_name]
    return "slipway image build " + shlex.join([words[0], *(w for w in words[1:] if w.startswith("image."))])


def kept_build(cfg: Config, pin: ImagePin) -> Optional[str]:
    """The key of the build whose unpacked pyxis container the nodes keep for later jobs
    (container.keep_builds); None: every attempt unpacks its own. Only a squashfs whose content
    slipway knows (build or bytes' hash) is kept: a registry tag can move under a kept container."""
    if cfg.container.runtime != "pyxis" or cfg.container.keep_builds < 1 or pin.path is None:
        return None
    identity = pin.build_hash or pin.sha256
    return f"i{identity[:16]}" if identity else None


def container_project(cfg: Config, project_dir: Path) -> Optional[str]:
    """The token of `cfg`'s jobs' pyxis containers (slipway-TOKEN-...), None without pyxis: the
    checkout's project, so a job's sweep on a node and `slipway image containers` act on its own."""
    if cfg.container.runtime != "pyxis":
        return None
    return Project.of(build_root(project_dir, cfg.image.dockerfile)).token
