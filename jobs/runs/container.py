"""What runs on the nodes is what was built and submitted.

Two things cross from the login node into the container, and both are
resolved once, here, at submission:

- the image: `container.image` (or, when it is empty, what `make image` built
  for this config) is pinned to one content-addressed squashfs file, whose
  absolute path goes into the EDF or the pyxis flags and whose build hash,
  tag, size and mtime go into the manifest. A later `make image` repoints
  `images/NAME.sqsh` but cannot change what a submitted run uses.
- the paths the trainer reads and writes: the run directory, the token cache,
  the Hugging Face cache, local datasets, tokenizers, checkpoints to start
  from and custom training scripts. Relative ones are made absolute in the
  frozen config, and each is mounted at the same path inside the container
  unless a user mount already shows it there. A user mount that would cover
  one of them with something else is refused with the fix.

`run_environment` gives the container environment a run uses; every way into
the container turns it into srun flags through `edf.srun_flags`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shlex
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from edf import Environment, Mount, expand_host, is_local_image, resolve_base
from containers.context import build_root
from containers.image import ImagePlan, image_plan
from containers.project import Project
from containers.record import BuildRecord
from common.errors import ConfigError, bounded_path, shown
from common.fs import file_sha256
from common.rundir import CodeSnapshot, RunDir
from common.schema import require
from jobs.config import Config
from jobs.slurm.script import Pins


# ---------------------------------------------------------------- the image


SOURCES = ("build", "file", "registry", "base_environment", "none")


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
        require(self.source in SOURCES, f"{where}.source", f"{shown(self.source)} is not one of {', '.join(SOURCES)}")

    def pins(self, code: Optional[CodeSnapshot], build: Optional[str], project: Optional[str] = None) -> Pins:
        """What a job of this image checks on every node: the squashfs file by its size, mtime
        and (where known) bytes; `code`, the kept container's build key and the project whose
        name its containers carry ride along."""
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
    # A squashfs slipway did not build: its bytes are its identity (read once per submission).
    return ImagePin(reference, str(real), source, str(real), st.st_size, mtime, sha256=file_sha256(real))


def pin_image(cfg: Config, project_dir: Path, notes: Optional[list[str]] = None) -> ImagePin:
    """The image `cfg` runs, pinned; a one-line error when there is none to run (what the user
    should know besides goes to `notes`)."""
    c = cfg.container
    if not c.in_container:
        return ImagePin("", "", "none")
    if c.image:
        if not is_local_image(c.image):
            return ImagePin(c.image, c.image, "registry")
        path = Path(expand_host(c.image, "container.image"))
        path = path if path.is_absolute() else project_dir / path
        if not path.is_file():
            raise ConfigError("container.image", f"squashfs {c.image} ({path}) does not exist: run `make image "
                                                 f"CONFIG={cfg.config_name}` (it prints the path), or set container.image")
        return _file_pin(c.image, path, "file")
    if c.base_environment:
        base = resolve_base(replace(c, image="", base_environment=list(c.base_environment)))
        if base.image:
            if is_local_image(base.image):
                field = _base_field(c, lambda env: env.image == base.image)
                path = Path(expand_host(base.image, field))
                path = path if path.is_absolute() else project_dir / path
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
    from containers.context import resolve_path

    out_dir = resolve_path(root, cfg.image.output_dir)
    found = []
    for sidecar in out_dir.glob(f"{cfg.image.name}-*.json") if out_dir.is_dir() else ():
        record = BuildRecord.read(sidecar)
        if record is not None and record.name == cfg.image.name and Path(record.squashfs).is_file() \
                and Path(record.squashfs).resolve() == sidecar.with_suffix(".sqsh").resolve():
            found.append((record.built_at, sidecar.stat().st_mtime_ns, record))
    return [record for *_, record in sorted(found, key=lambda x: x[:2], reverse=True)]


def build_of_settings(cfg: Config, project_dir: Path, notes: Optional[list[str]] = None) -> BuildRecord:
    """The build a submission of `cfg` runs: the newest whose image settings are the config's (the
    same hash; with a code snapshot, any build that differs in code alone, which the snapshot
    brings). Switching between image variants then runs each its own build, not the latest. With
    none, one line naming what differs from the closest build and the command that builds it.
    Where the settings cannot be worked out here (no checkout with the Dockerfile: an install of
    slipway without its sources), the newest build, with a note in `notes`."""
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


def _base_field(env: Environment, has: Callable[[Environment], bool]) -> str:
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


# The build context's sources but pyproject.toml are code, not what the image must install: with
# a code snapshot (code.snapshot, jobs/runs/code.py) the job never runs the image's copy of them,
# so a change to them alone needs no rebuild. pyproject.toml (the dependencies), the Dockerfile,
# the build args and the wheels do.


def build_differences(record: Optional[BuildRecord], plan: ImagePlan, *, code_snapshot: bool = False) -> list[str]:
    """What differs between a build `record` and the build `plan` would make, one phrase each,
    in the config's terms (None: the record is gone). Empty when the hashes agree, or, with
    `code_snapshot`, when only code differs (the snapshot brings it: nothing to rebuild)."""
    if record is not None and record.hash == plan.hash:
        return []
    if record is None or record.build_args is None:
        return ["what differs is not known: the build's record is gone"]
    from containers.context import UNHASHED_ARGS

    out: list[str] = []
    old, new = record.build_args, plan.build_args
    for key in sorted((set(old) | set(new)) - set(UNHASHED_ARGS)):
        if old.get(key) != new.get(key):
            what = _BUILD_ARG_FIELDS.get(key, f"image.build_args.{key}")
            if key == "WHEELHOUSE_DIGEST":
                out.append(f"{what} changed")
            else:
                out.append(f"{what} {_shown_arg(key, old.get(key))} -> {_shown_arg(key, new.get(key))}")
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
    """`slipway image build` with the user's own CONFIG and image.* overrides: only the image
    section (and the checkout) decide a build, so this builds exactly what this config's
    submission looks for, and a suggestion never repeats an override unrelated to the image."""
    words = shlex.split(cfg.given_args) if cfg.given_args else [cfg.config_name]
    return "slipway image build " + shlex.join([words[0], *(w for w in words[1:] if w.startswith("image."))])


# ---------------------------------------------------------------- the paths


@dataclass(frozen=True)
class Need:
    """A host path the job uses, to be seen at the same path inside the container."""

    path: Path  # absolute, variables expanded
    what: str  # for messages: "the run directory", "data.cache_dir (the token cache)"
    writable: bool
    create: bool  # a directory slipway creates at submission if missing


def _expand(value: str, field: str) -> str:
    return os.path.expanduser(expand_host(value, field))


def _absolute(value: str, field: str, base: Path) -> Path:
    path = Path(_expand(value, field))
    return path if path.is_absolute() else base / path


def _is_path(value: Optional[str], field: str) -> bool:
    """A dataset or tokenizer given as a path rather than a hub name (or builtin)."""
    if not value or value == "builtin":
        return False
    if value.startswith(("/", "./", "../", "~", "$")):
        return True
    try:
        return Path(_expand(value, field)).exists()
    except ConfigError:
        return False


def _glob_root(path: Path) -> Path:
    """The directory above the first wildcard of a glob (what a mount must show)."""
    parts = []
    for part in path.parts:
        if any(c in part for c in "*?["):
            break
        parts.append(part)
    return Path(*parts)


def default_token_cache(paths: RunDir) -> Path:
    """The token cache every run of a project shares: `.cache/tokens` beside `runs/`."""
    return paths.path.parent.parent / ".cache" / "tokens"


def default_hf_home(paths: RunDir) -> Path:
    return paths.project / ".cache" / "huggingface"


def resolve_paths(cfg: Config, paths: RunDir) -> Config:
    """`cfg` with every path the trainer reads made absolute (relative ones are relative
    to the project directory, where slipway runs), and the token cache named: the frozen
    config then means the same on every node, whatever the container's working directory."""
    # A copy of the sections it changes (the rest is shared, read only): a sweep resolves a thousand.
    cfg = copy.copy(cfg)
    cfg.data, cfg.model, cfg.train = copy.copy(cfg.data), copy.copy(cfg.model), copy.copy(cfg.train)
    base = paths.project
    d = cfg.data
    d.cache_dir = str(_absolute(d.cache_dir, "data.cache_dir", base)) if d.cache_dir else \
        str(default_token_cache(paths))
    for field_name in ("dataset", "tokenizer", "validation_split"):
        value = getattr(d, field_name)
        if _is_path(value, f"data.{field_name}") and not value.startswith("$"):
            setattr(d, field_name, str(_absolute(value, f"data.{field_name}", base)))
    if cfg.model.init_from_hf and not cfg.model.init_from_hf.startswith("$"):
        cfg.model.init_from_hf = str(_absolute(cfg.model.init_from_hf, "model.init_from_hf", base))
    if cfg.train.script and not cfg.train.script.startswith("$"):
        cfg.train.script = str(_absolute(cfg.train.script, "train.script", base))
    return cfg


def needed_paths(cfg: Config, paths: RunDir) -> list[Need]:
    """Every host path the job reads or writes by name (`cfg` already through `resolve_paths`)."""
    needs = [Need(paths.path, "the run directory", True, False)]
    needs.append(Need(_absolute(cfg.data.cache_dir or str(default_token_cache(paths)), "data.cache_dir",
                                paths.project), "data.cache_dir (the token cache)", True, True))
    hf = _absolute(cfg.launch.hf_home, "launch.hf_home", paths.project) if cfg.launch.hf_home else \
        default_hf_home(paths)
    needs.append(Need(hf, "launch.hf_home (the Hugging Face cache)", True, True))
    for field_name in ("dataset", "tokenizer", "validation_split"):
        value = getattr(cfg.data, field_name)
        if _is_path(value, f"data.{field_name}"):
            path = _glob_root(_absolute(value, f"data.{field_name}", paths.project))
            needs.append(Need(path, f"data.{field_name}", False, False))
    if cfg.model.init_from_hf:
        needs.append(Need(_absolute(cfg.model.init_from_hf, "model.init_from_hf", paths.project),
                          "model.init_from_hf", False, False))
    if cfg.train.script:
        script = _absolute(cfg.train.script, "train.script", paths.project)
        needs.append(Need(script.parent, "train.script's directory", False, False))
    # One mount for a path inside another one that is mounted anyway (a writable one wins);
    # the rest in the order above.
    kept: list[Need] = []
    for need in sorted(needs, key=lambda n: (len(n.path.parts), not n.writable)):
        outer = next((k for k in kept if need.path == k.path or k.path in need.path.parents), None)
        if outer is None or (need.writable and not outer.writable):
            kept.append(need)
    return [need for need in needs if need in kept]


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _user_mounts(env: Environment) -> list[tuple[int, Mount, Path, Path]]:
    """(index, mount, source, destination) with host variables expanded."""
    out = []
    for i, mount in enumerate(env.mounts):
        where = f"container.mounts[{i}]"
        out.append((i, mount, Path(_expand(mount.src, where)), Path(_expand(mount.dst, where))))
    return out


def visibility_mounts(cfg: Config, paths: RunDir) -> list[Mount]:
    """The mounts to add so that every needed path is seen at its own path in the container;
    a one-line error if a user mount would hide one of them."""
    return [mount for _, mount in _visibility(cfg, paths)]


def _visibility(cfg: Config, paths: RunDir) -> list[tuple[Need, Mount]]:
    env = cfg.container
    if not env.in_container:
        return []
    user = _user_mounts(env)
    if env.workdir is not None:
        # The trainer's paths are absolute, so the workdir only matters for what the user runs
        # by hand; check that it is a path at all (variables set).
        _expand(env.workdir, "container.workdir")
    added: list[tuple[Need, Mount]] = []
    for need in needed_paths(cfg, paths):
        shown = False
        for i, mount, src, dst in user:
            if _within(dst, need.path) and not (dst == need.path and src == need.path):
                raise ConfigError(f"container.mounts[{i}]", f"{mount.spec()!r} is mounted at {dst}, which is "
                                  f"{need.what} ({need.path}) or inside it, so the job would not see it there: "
                                  "mount it elsewhere or drop it")
            if _within(need.path, dst):  # mounts apply in order: the last one over the path decides
                shown = src / need.path.relative_to(dst) == need.path and not (need.writable and "ro" in mount.flags)
        if not shown:
            flags = () if need.writable else ("ro",)
            added.append((need, Mount(str(need.path), str(need.path), flags)))
    return added


def create_needed_dirs(cfg: Config, paths: RunDir) -> list[Path]:
    """Mount sources must exist: make the cache directories the job will fill (in a container;
    without one the trainer makes them itself). Returns the directories it created."""
    if not cfg.container.in_container:
        return []
    created: list[Path] = []
    try:
        for need in needed_paths(cfg, paths):
            field = need.what.split(" ")[0]
            try:
                if need.create:
                    missing = [p for p in (need.path, *need.path.parents) if not p.exists()]
                    need.path.mkdir(parents=True, exist_ok=True)
                    created += missing
                elif not need.path.exists() and need.what != "the run directory":
                    raise ConfigError(field, f"{bounded_path(need.path)} does not exist on this node")
            except OSError as exc:  # not writable, or a name longer than the filesystem takes
                raise ConfigError(field, f"cannot create {bounded_path(need.path)} ({exc.strerror}): point it at "
                                         "a writable shared directory with a shorter path") from None
    except BaseException:  # a refused submission leaves none of the directories it made
        remove_created_dirs(created)
        raise
    return created


def remove_created_dirs(created: list[Path]) -> None:
    """Undo `create_needed_dirs` where the directories stayed empty (a submission that failed)."""
    for path in sorted(created, key=lambda p: len(p.parts), reverse=True):
        try:
            path.rmdir()
        except OSError:
            pass


def kept_build(cfg: Config, pin: ImagePin) -> Optional[str]:
    """The key of the image build whose unpacked pyxis container the nodes keep for later jobs
    (container.keep_builds), or None: every attempt unpacks its own. Only a squashfs file whose
    content slipway knows (its build hash, or its bytes' hash) is kept: a registry tag can move,
    and a container kept under its name would outlive what the tag names."""
    if cfg.container.runtime != "pyxis" or cfg.container.keep_builds < 1 or pin.path is None:
        return None
    identity = pin.build_hash or pin.sha256
    return f"i{identity[:16]}" if identity else None


def container_project(cfg: Config, project_dir: Path) -> Optional[str]:
    """The token pyxis containers of `cfg`'s jobs are named with (slipway-TOKEN-...): the project
    of the checkout its image builds from, so that a job's sweep on a node and `slipway image
    containers` act on this project's alone; None without pyxis."""
    if cfg.container.runtime != "pyxis":
        return None
    return Project.of(build_root(project_dir, cfg.image.dockerfile)).token


def run_environment(cfg: Config, paths: RunDir, pin: ImagePin, code: Optional[CodeSnapshot] = None) -> Environment:
    """The container environment of a run: the config's, with the pinned image, the mounts
    that make its paths visible, and the code snapshot (mounted read-only at its own path, in
    front of the image's baked trainer); runtime none: the config's, unused."""
    env = cfg.container
    if not env.in_container:
        return env
    out = _with_code(replace(env, image=pin.image or env.image, mounts=[*env.mounts, *visibility_mounts(cfg, paths)]),
                     code)
    out.check("container")
    return out


def _with_code(env: Environment, code: Optional[CodeSnapshot]) -> Environment:
    """`env` with the code snapshot mounted read-only at its own path, in front of the image's
    baked trainer. A PYTHONPATH of the config's own, or the submitting environment's
    (env_from_host), stays behind the snapshot; the image's is replaced. The snapshot's variables
    are set here, so a name of env_from_host among them is passed inside their value, not beside it."""
    if code is None:
        return env
    values, from_host = dict(env.env), list(env.env_from_host)
    own = env.env.get("PYTHONPATH") or ("${PYTHONPATH}" if "PYTHONPATH" in from_host else None)
    values.update(code.environment(own))
    return replace(env, mounts=[*env.mounts, Mount(code.dir, code.dir, ("ro",))], env=values,
                   env_from_host=[name for name in from_host if name not in values])


def shell_environment(cfg: Config, paths: RunDir, pin: ImagePin,
                      code: Optional[CodeSnapshot] = None) -> tuple[Environment, list[str]]:
    """The container environment of `slipway shell`: the run's, with the checkout's code as the
    code snapshot `code` (what a submission now would run, not the image's baked trainer), less
    the paths the job would create that do not exist yet (a shell writes nothing into a run: the
    run directory only ever comes from a submission, which creates it whole, and the caches from
    a submission or `prepare`), and with every mount source checked on this node, so that a
    missing one is one line before srun starts rather than a failure after the image is
    unpacked. Returns it and notes for the user."""
    env = cfg.container
    if not env.in_container:
        return env, []
    kept: list[Mount] = []
    left_out: list[Need] = []
    for need, mount in _visibility(cfg, paths):
        if need.path.exists():
            kept.append(mount)
        elif need.writable:
            left_out.append(need)
        else:
            raise ConfigError(need.what.split(" ")[0].removesuffix("'s"),
                              f"{bounded_path(need.path)} does not exist on this node, "
                                                       "so the shell cannot mount it: fix the path or create it")
    for i, _, src, _ in _user_mounts(env):
        if not src.exists():
            raise ConfigError(f"container.mounts[{i}]", f"mount source {bounded_path(src)} does not exist on this "
                                                        "node: create it, or drop the mount")
    if env.base_environment:
        merged = resolve_base(replace(env, mounts=[]))
        for mount in merged.mounts:
            src = Path(_expand(mount.src, "container.base_environment"))
            if not src.exists():
                field = _base_field(env, lambda one, m=mount: m in one.mounts)
                raise ConfigError(field, f"the base environment mounts {bounded_path(src)}, which does not exist "
                                         "on this node: create it, or fix that EDF's mounts")
    notes = [f"not mounted in the shell: {need.what} {need.path} does not exist yet (a submission creates "
             "it; the shell creates nothing)" for need in left_out]
    out = _with_code(replace(env, image=pin.image or env.image, mounts=[*env.mounts, *kept]), code)
    out.check("container")
    return out, notes
