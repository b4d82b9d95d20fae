"""Build the training image with podman, import it into a squashfs with enroot (docs/image.md).

The image is content-addressed: a hash of the Dockerfile, the build args and every file of the build
context (assembled from exactly the files hashed, so nothing else can change the image) names the
podman tag, `localhost/NAME:HASH12-PROJECT`; with the squash options it names the squashfs,
`OUTPUT_DIR/NAME-HASH12.sqsh`. An unchanged tree returns at once without podman; a change only the
import reads imports the image podman has. `NAME.sqsh` is a symlink to the current squashfs,
replaced atomically. A build holds its tag's lock (containers/project.py) through its import.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import re
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

from rich.console import Console
from rich.markup import escape

from containers.context import (
    HashCache,
    content_hashes,
    context_files,
    materialize_context,
    project_root,
    project_version,
    resolve_path,
)
from containers.diagnose import diagnose_build
from containers.importer import enroot_import, host_name
from containers.plan import ImagePlan
from containers.project import Project
from containers.record import BuildRecord, ImageNeeds, ImageSection
from containers.storage import check_storage_conf
from containers.tools import Enroot, Podman, ToolError, git_state, stream
from common.errors import ConfigError, human
from common.fs import write_atomic


class ImageConfig(Protocol):
    """What the image functions read of a config (jobs.config.Config is one)."""

    image: ImageSection

    @property
    def image_needs(self) -> ImageNeeds: ...


# flash-attn compile settings, passed through the build context's buildenv/ (containers/Dockerfile), not as
# build args, so they change neither the image hash nor podman's layer cache; `make image`'s environment
# (MAX_JOBS=4 make image) overrides image.build_args.
BUILD_ENV_KEYS = ("MAX_JOBS", "NVCC_THREADS")
FLOAT8_EXTRA = "float8"  # pyproject's extra for train.float8 (torchao); trainer/compute.py names it too


def build_env(build_args: dict[str, str]) -> dict[str, str]:
    """MAX_JOBS / NVCC_THREADS for the flash-attn compile: image.build_args, then this process's environment."""
    env: dict[str, str] = {}
    for key in BUILD_ENV_KEYS:
        for where, value in ((f"image.build_args.{key}", build_args.get(key)),
                             (f"{key} (in the environment of make image)", os.environ.get(key))):
            value = "" if value is None else str(value).strip()
            if not value:
                continue
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(where, f"must be a whole number >= 1, got {value!r} (e.g. {key}=4)")
            env[key] = value
    return env


def _build_args(cfg: ImageConfig, root: Path, wheel_digest: str, git: bool) -> dict[str, str]:
    """slipway's own build args, then the user's (image.build_args less BUILD_ENV_KEYS), each checked."""
    image = cfg.image
    build_args = {
        "BASE_IMAGE": image.base_image,
        "FLASH_ATTN": "1" if image.flash_attn else "0",
        "WHEELHOUSE": "offline" if image.wheelhouse else "",
        "WHEELHOUSE_DIGEST": wheel_digest,
        "SLIPWAY_VERSION": project_version(root),
    }
    # Beyond the Dockerfile's defaults, named only when needed: a config that needs nothing more keeps its image.
    needs = cfg.image_needs
    if needs.numactl:
        build_args["NUMACTL"] = "1"
    if needs.float8:
        build_args["EXTRAS"] = FLOAT8_EXTRA
    user_args = {k: str(v) for k, v in image.build_args.items() if k not in BUILD_ENV_KEYS}
    for key, instead in (("FLASH_ATTN", "set image.flash_attn: true or false instead"),
                         ("NUMACTL", "1 installs numactl where the base lacks it")):
        if user_args.get(key, "0") not in ("0", "1"):
            raise ConfigError(f"image.build_args.{key}", f"must be 0 or 1, got {user_args[key]!r}: {instead}")
    if needs.numactl and user_args.get("NUMACTL") == "0":
        raise ConfigError("image.build_args.NUMACTL", "0 leaves numactl out, but the node preset binds each rank to "
                                                      "a NUMA node with it: remove the build arg, or set "
                                                      "launch.preset: none")
    if "EXTRAS" in user_args:  # the user's extras, and float8 where the run needs it
        user_args["EXTRAS"] = " ".join(dict.fromkeys(user_args["EXTRAS"].replace(",", " ").split()
                                                     + build_args.get("EXTRAS", "").split()))
    build_args.update(user_args)
    if not user_args.get("GIT_COMMIT"):  # HEAD's commit, -dirty where tracked files differ
        state = git_state(root) if git else {"commit": None}
        build_args["GIT_COMMIT"] = state["commit"] + ("-dirty" if state["dirty"] else "") if state["commit"] else "unknown"
    return build_args


def image_plan(cfg: ImageConfig, *, root: Path | None = None, force: bool = False, enroot_mount: bool | None = None,
               git: bool = True) -> ImagePlan:
    """Hash, tag, paths and the exact command lines; `enroot_mount`: pass `-x mount` (None: ask enroot)."""
    image = cfg.image
    root = (root or project_root()).resolve()
    dockerfile = resolve_path(root, image.dockerfile)
    if not dockerfile.is_file():
        raise ConfigError("image.dockerfile", f"{dockerfile} does not exist (default: containers/Dockerfile)")
    out = resolve_path(root, image.output_dir)
    files = context_files(root, image)
    cache = HashCache(out / ".hashcache.json")
    wheels = "".join(f"{f.dest} {cache.digest(f.src)}\n" for f in files if f.dest.startswith("wheels/"))
    build_args = _build_args(cfg, root, hashlib.sha256(wheels.encode()).hexdigest()[:16] if wheels else "", git)
    digest, image_digest, inputs = content_hashes(dockerfile=dockerfile.read_text(), build_args=build_args,
                                                  squash_options=image.squash_options, files=files, cache=cache)
    cache.save()
    h12 = digest[:12]
    try:
        project, project_error = Project.of(root), None
    except ConfigError as exc:  # a read-only checkout: a plan still tells hashes apart
        project, project_error = None, exc
    tag = f"localhost/{image.name}:{image_digest[:12]}" + (f"-{project.token}" if project else "")
    context_dir = out / f".context-{h12}"
    squashfs = out / f"{image.name}-{h12}.sqsh"
    temp = out / f".{squashfs.name}.tmp-{host_name()}-{os.getpid()}"
    if enroot_mount is None:
        enroot_mount = bool((enroot := Enroot.find()) and enroot.supports_mount())
    return ImagePlan(
        name=image.name, hash=digest, tag=tag, root=root, output_dir=out, dockerfile=dockerfile, files=files,
        build_args=build_args, squash_options=image.squash_options, squashfs=squashfs, temp_squashfs=temp,
        link=out / f"{image.name}.sqsh", record=out / f"{image.name}.json",
        sidecar=out / f"{image.name}-{h12}.json", log=out / "logs" / f"{image.name}-{h12}.log",
        context_dir=context_dir,
        podman_argv=Podman.build_argv(tag=tag, dockerfile=dockerfile, context=context_dir, build_args=build_args,
                                      labels=project.labels if project else {}, network_host=image.network_host,
                                      isolation=image.isolation, no_cache=force),
        enroot_argv=Enroot.import_argv(output=temp, uri=f"podman://{tag}", mount=enroot_mount),
        enroot_env={"ENROOT_SQUASH_OPTIONS": image.squash_options}, enroot_mount=enroot_mount,
        build_env=build_env(image.build_args), build_on=image.build_on, inputs=inputs, project=project,
        project_error=project_error,
        frozen_config=out / f".build-{h12}.yaml" if image.build_on == "compute" else None,
    )


# ---------------------------------------------------------------- records


def make_current(plan: ImagePlan, record: BuildRecord) -> None:
    """Record `plan`'s image as current; point the link at its squashfs atomically and relatively (the dir may move)."""
    write_atomic(plan.record, record.to_json())
    link = plan.link
    if link.exists() and not link.is_symlink():
        raise ToolError(f"{link} is a regular file, not slipway's link to the current image: move it away "
                        f"(slipway keeps {link.name} as a symlink to {link.stem}-HASH.sqsh)")
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(plan.squashfs, link.parent), tmp)
    os.replace(tmp, link)


def build_record(plan: ImagePlan, *, image_id: str | None, enroot_version: str | None,
                 cuda: str | None = None) -> BuildRecord:
    default = re.search(r"^ARG FLASH_ATTN_CUDA_ARCHS=(.*)$", plan.dockerfile.read_text(), re.M)
    archs = plan.build_args.get("FLASH_ATTN_CUDA_ARCHS", default[1].strip() if default else None)
    if plan.build_args.get("FLASH_ATTN") == "0":
        archs = None
    return BuildRecord(
        cuda=cuda, flash_attn_archs=(archs or "80;90;100;120") if archs is not None else None,  # "": its default
        name=plan.name, hash=plan.hash, tag=plan.tag, squashfs=str(plan.squashfs.resolve()),
        size_bytes=plan.squashfs.stat().st_size,
        built_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        base_image=plan.build_args.get("BASE_IMAGE"), git_commit=plan.build_args.get("GIT_COMMIT"),
        build_args=plan.build_args, build_env=plan.build_env, squash_options=plan.squash_options,
        inputs=plan.inputs, podman_image_id=image_id, enroot_version=enroot_version,
        enroot_mount=plan.enroot_mount, project=plan.project.id if plan.project else None)


def current_image(cfg: ImageConfig, *, root: Path | None = None) -> Optional[BuildRecord]:
    """The record of the current image (`OUTPUT_DIR/NAME.json`), or None."""
    root = (root or project_root()).resolve()
    return BuildRecord.read(resolve_path(root, cfg.image.output_dir) / f"{cfg.image.name}.json")


def resolve_image(cfg: ImageConfig, *, root: Path | None = None) -> Path | None:
    """The current squashfs as an absolute path with the link resolved, or None."""
    record = current_image(cfg, root=root)
    if record and Path(record.squashfs).is_file():
        return Path(record.squashfs).resolve()
    link = resolve_path((root or project_root()).resolve(), cfg.image.output_dir) / f"{cfg.image.name}.sqsh"
    return link.resolve() if link.is_file() else None


# ---------------------------------------------------------------- build and import


@dataclass
class ImageResult:
    plan: ImagePlan
    squashfs: Optional[Path]  # None with do_import=False
    built: bool  # podman build ran
    seconds: float
    record: Optional[BuildRecord] = None
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: plan, build, import (where it ran)


def _podman_build(plan: ImagePlan, podman: Podman, console: Console) -> None:
    materialize_context(plan.files, plan.context_dir, plan.build_env)
    tail = deque(maxlen=15)
    console.print(f"[bold]podman build[/] {plan.tag}  (base {escape(str(plan.build_args.get('BASE_IMAGE')))}, "
                  f"{len(plan.files)} context files, log {escape(str(plan.log))})", highlight=False)
    try:
        with plan.log.open("w") as log, console.status("podman build") as status:
            log.write("$ " + " ".join(plan.podman_argv) + "\n")

            pending: list[str] = []  # a STEP line, printed once we know whether it was cached

            def flush(suffix: str = "") -> None:
                if pending:
                    step = " ".join(pending.pop().split())
                    room = max(console.width - 4 - len(suffix), 20)
                    step = step if len(step) <= room else step[: room - 1] + "…"
                    console.print(f"  {step}{suffix}", style="cyan", no_wrap=True, highlight=False, markup=False)

            def on_line(line: str) -> None:
                log.write(line + "\n")
                tail.append(line)
                cached = line.startswith("--> Using cache")
                flush(" (cached)" if cached else "")
                if line.startswith("STEP "):
                    pending.append(line)
                elif not cached and ("smoke ok" in line or line.startswith(("pip_requirements:", "flash-attn",
                                                                            "numactl", "dependencies FAILED"))):
                    console.print(f"    {escape(line)}", no_wrap=True, overflow="ellipsis", highlight=False)
                status.update(f"podman build: {escape(line[:100])}")

            rc = stream([podman.exe, *plan.podman_argv[1:]], on_line)
            flush()
    finally:
        shutil.rmtree(plan.context_dir, ignore_errors=True)
    if rc != 0:
        console.print("\n".join(tail), style="red", highlight=False, markup=False)
        # The whole log, not the tail: a compiler's first error can be thousands of lines up.
        raise ToolError(diagnose_build(plan.log.read_text(errors="replace"), build_args=plan.build_args,
                                       log=plan.log, rc=rc))


def build_image(cfg: ImageConfig, *, force: bool = False, do_import: bool = True, console: Console | None = None,
                root: Path | None = None, here: bool = False,
                elsewhere: Optional[Callable[[ImagePlan], None]] = None) -> ImageResult:
    """Build (podman) and import (enroot) the image unless its squashfs exists. `force`: without podman's
    layer cache, and reimport; `here`: on this machine even with image.build_on: compute (what the srun
    runs); `elsewhere`: how a build_on: compute build runs (jobs/cli/image.py gives it)."""
    console = console or Console()
    t0 = time.perf_counter()
    plan = image_plan(cfg, root=root, force=force)
    # The build and the import both log there: the import alone runs when podman still has
    # the image but the output directory is new (images/ removed, image.output_dir changed).
    plan.log.parent.mkdir(parents=True, exist_ok=True)
    timings = {"plan": time.perf_counter() - t0}
    if do_import and plan.exists and not force:
        record = BuildRecord.read(plan.sidecar) or build_record(plan, image_id=None, enroot_version=None)
        current = BuildRecord.read(plan.record)
        if not current or current.hash != plan.hash or not plan.link.is_symlink() \
                or plan.link.resolve() != plan.squashfs.resolve():
            make_current(plan, record)
        console.print(f"image up to date: {plan.squashfs} ({human(plan.squashfs.stat().st_size)}, "
                      f"tag {plan.tag})", highlight=False, markup=False)
        return ImageResult(plan, plan.squashfs, built=False, seconds=time.perf_counter() - t0, record=record,
                           timings=timings)
    if plan.build_on == "compute" and not here:
        if elsewhere is None:
            raise ToolError("image.build_on: compute builds through Slurm: run it with slipway image build CONFIG "
                            "(or set image.build_on: local)")
        elsewhere(plan)
        return ImageResult(plan, plan.squashfs if plan.exists else None, built=True, seconds=time.perf_counter() - t0,
                           record=BuildRecord.read(plan.sidecar))
    return _build_here(plan, force=force, do_import=do_import, console=console, t0=t0, timings=timings)


def _build_here(plan: ImagePlan, *, force: bool, do_import: bool, console: Console, t0: float,
                timings: dict[str, float]) -> ImageResult:
    """The podman build (unless podman has the tag) and enroot's import, on this machine."""
    if plan.project is None:
        assert plan.project_error is not None
        raise plan.project_error
    podman = Podman.find()
    enroot = Enroot.find() if do_import else None
    if do_import and enroot is None:
        console.print("[yellow]warning:[/] enroot not found: the podman image will be built, the import skipped")
    for check in check_storage_conf():
        if not check.ok:
            console.print(f"[yellow]warning:[/] {escape(check.what)}: {escape(check.fix or '')}", highlight=False)
    with plan.project.building(plan.tag) as guarded:
        if not guarded:
            console.print(f"[yellow]note:[/] {escape(str(plan.project.lock_path(plan.tag).parent))} has no flock: a "
                          "slipway image prune meanwhile cannot tell that this build runs", highlight=False)
        built = force or not podman.image_exists(plan.tag)
        if built:
            t1 = time.perf_counter()
            _podman_build(plan, podman, console)
            timings["build"] = time.perf_counter() - t1
        else:
            console.print(f"podman image {plan.tag} exists: not rebuilding" + (" (only the import's settings differ)"
                          if do_import else ""), highlight=False, markup=False)
        if not do_import:
            console.print(f"[green]built[/] {plan.tag} ({time.perf_counter() - t0:.1f} s); import skipped "
                          "(--no-import)", highlight=False)
            return ImageResult(plan, None, built=built, seconds=time.perf_counter() - t0, timings=timings)
        if enroot is None:
            raise ToolError(f"enroot not found: install enroot (https://github.com/NVIDIA/enroot) or run `make "
                            f"image` on a node that has it; the podman image {plan.tag} is built")
        t1 = time.perf_counter()
        notes = enroot_import(plan, enroot, podman, console)
        timings["import"] = time.perf_counter() - t1
    record = build_record(plan, image_id=podman.image_id(plan.tag), enroot_version=enroot.version(),
                          cuda=podman.image_env(plan.tag).get("CUDA_VERSION"))
    write_atomic(plan.sidecar, record.to_json())
    make_current(plan, record)
    seconds = time.perf_counter() - t0
    console.print(f"[green]image ready[/]: {escape(str(plan.squashfs))} ({human(record.size_bytes)}) in "
                  f"{seconds:.0f} s; {escape(plan.link.name)} -> {escape(plan.squashfs.name)}", highlight=False)
    return ImageResult(plan, plan.squashfs, built=built, seconds=seconds, record=record, notes=notes, timings=timings)


def next_steps(plan: ImagePlan, *, force: bool = False, do_import: bool = True, here: bool = False) -> list[str]:
    """What `build_image` would run for `plan`, one line each (none: nothing), asking podman
    whether the tag exists but running nothing (`slipway image build --dry-run`)."""
    if do_import and plan.exists and not force:
        return []
    if plan.build_on == "compute" and not here:
        return ["srun: build and import on a compute node (image.build_on: compute), whose own podman storage "
                "decides whether the podman build runs and which of its steps come from its layer cache"]
    steps = []
    if force:
        steps.append(f"podman build {plan.tag}: every Dockerfile step, without the layer cache (--force)")
    elif not Podman.available():
        steps.append(f"podman build {plan.tag}: podman is not on PATH here, so whether the image exists cannot be "
                     "told (a build fails without it)")
    elif Podman.find().image_exists(plan.tag):
        steps.append(f"no podman build: podman has {plan.tag}, built from the same Dockerfile, build args and files")
    else:
        steps.append(f"podman build {plan.tag}: podman does not have it; steps whose inputs did not change come from "
                     "the layer cache")
    if do_import:
        steps.append(f"enroot import -> {plan.squashfs} ({'--force' if force and plan.exists else 'not there yet'})")
    return steps
