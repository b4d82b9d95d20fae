"""Build the training image with podman, import it into a squashfs with enroot.

The image is content-addressed: a hash of the Dockerfile, the build args and
every file of the build context names both the podman tag
(`localhost/NAME:HASH12`) and the squashfs (`OUTPUT_DIR/NAME-HASH12.sqsh`), so an
unchanged tree finds its squashfs and returns at once, without podman. The
build context is assembled from exactly the files that are hashed (`src/` and
`wheels/`, see containers/Dockerfile), so nothing outside it can change the
image nor its hash.

Each build records itself in `NAME-HASH12.json` beside the squashfs and, once
current, in `NAME.json`; `NAME.sqsh` is a symlink to the current squashfs,
replaced atomically, so configs can name one stable path. The squashfs under
its final name only ever appears by rename from a temporary file.

A failed build is explained by containers/diagnose.py; the stopped podman
container that enroot's import leaves (containers.tools.Enroot) is removed
after each import, and containers/prune.py removes older ones.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

from rich.console import Console
from rich.markup import escape

from containers.context import (
    ContextFile,
    HashCache,
    content_hash,
    context_files,
    input_digests,
    materialize_context,
    project_root,
    project_version,
    resolve_path,
)
from containers.diagnose import diagnose_build
from containers.record import BuildRecord, ImageNeeds, ImageSection
from containers.storage import check_storage_conf
from containers.tools import Container, Enroot, Podman, Tail, ToolError, git_commit, squashfs_ok
from common.environ import as_typed
from common.errors import ConfigError
from common.fs import pid_alive, write_atomic



class ImageConfig(Protocol):
    """What the image functions read of a config (jobs.config.Config is one): its image section,
    and what the run needs of the image beyond the trainer."""

    image: ImageSection

    @property
    def image_needs(self) -> ImageNeeds: ...


# enroot unpacks the image (its uncompressed size) before squashing it to about half.
SQUASH_RATIO = 0.5
# flash-attn compile settings that do not change the image: passed through the
# build context's buildenv/ (containers/Dockerfile), not as build args, so they
# change neither the image hash nor podman's layer cache. image.build_args sets
# them; the environment of `make image` (MAX_JOBS=4 make image) overrides that.
BUILD_ENV_KEYS = ("MAX_JOBS", "NVCC_THREADS")
FLOAT8_EXTRA = "float8"  # pyproject's extra for train.float8 (torchao); trainer/compute.py names it too


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---------------------------------------------------------------- the plan


@dataclass
class ImagePlan:
    """Everything a build would do, computed without running podman."""

    name: str
    hash: str
    tag: str
    root: Path
    output_dir: Path
    dockerfile: Path
    files: list[ContextFile]
    build_args: dict[str, str]
    squash_options: str
    squashfs: Path  # OUTPUT_DIR/NAME-HASH12.sqsh
    temp_squashfs: Path  # where enroot writes before the rename
    link: Path  # OUTPUT_DIR/NAME.sqsh -> the current squashfs
    record: Path  # OUTPUT_DIR/NAME.json: the current image
    sidecar: Path  # OUTPUT_DIR/NAME-HASH12.json: this image
    log: Path
    context_dir: Path
    podman_argv: list[str]
    enroot_argv: list[str]
    enroot_env: dict[str, str]
    enroot_mount: bool
    build_env: dict[str, str] = field(default_factory=dict)  # buildenv/flash-attn.env: MAX_JOBS, NVCC_THREADS
    # What the hash covers beyond build_args and squash_options, per part (Dockerfile, source
    # directories, wheels): recorded so that a later check names what changed, not just that something did.
    inputs: dict = field(default_factory=dict)
    build_on: str = "local"
    # image.build_on: compute: the config the srun's inner build reads (written by the caller).
    frozen_config: Optional[Path] = None

    @property
    def hash12(self) -> str:
        return self.hash[:12]

    @property
    def exists(self) -> bool:
        return self.squashfs.is_file()


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"


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


def image_plan(cfg: ImageConfig, *, root: Path | None = None, force: bool = False, do_import: bool = True,
               enroot_mount: bool | None = None, git: bool = True) -> ImagePlan:
    """Hash, tag, paths and the exact podman / enroot / srun command lines.

    `enroot_mount`: whether to pass `-x mount`; None asks the installed enroot.
    """
    image = cfg.image
    root = (root or project_root()).resolve()
    dockerfile = resolve_path(root, image.dockerfile)
    if not dockerfile.is_file():
        raise ConfigError("image.dockerfile", f"{dockerfile} does not exist (default: containers/Dockerfile)")
    out = resolve_path(root, image.output_dir)
    files = context_files(root, image)
    cache = HashCache(out / ".hashcache.json")
    wheels = [f for f in files if f.dest.startswith("wheels/")]
    wheel_digest = hashlib.sha256("".join(f"{f.dest} {cache.digest(f.src)}\n" for f in wheels).encode()).hexdigest()
    build_args = {
        "BASE_IMAGE": image.base_image,
        "FLASH_ATTN": "1" if image.flash_attn else "0",
        "WHEELHOUSE": "offline" if image.wheelhouse else "",
        "WHEELHOUSE_DIGEST": wheel_digest[:16] if wheels else "",
        "SLIPWAY_VERSION": project_version(root),
    }
    # What the run needs beyond the Dockerfile's defaults (no numactl, no extra, flash-attn for
    # 90): named only when needed, so a config that needs nothing more keeps its image.
    needs = cfg.image_needs
    if needs.numactl:
        build_args["NUMACTL"] = "1"
    if needs.float8:
        build_args["EXTRAS"] = FLOAT8_EXTRA
    user_args = {k: str(v) for k, v in image.build_args.items() if k not in BUILD_ENV_KEYS}
    for key, allowed, instead in (("FLASH_ATTN", ("0", "1"), "set image.flash_attn: true or false instead"),
                                  ("NUMACTL", ("0", "1"), "1 installs numactl where the base lacks it")):
        if user_args.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"image.build_args.{key}", f"must be 0 or 1, got {user_args[key]!r}: {instead}")
    if needs.numactl and user_args.get("NUMACTL") == "0":
        raise ConfigError("image.build_args.NUMACTL", "0 leaves numactl out, but the node preset binds each rank to "
                                                      "a NUMA node with it: remove the build arg, or set "
                                                      "launch.preset: none")
    if "EXTRAS" in user_args:  # the user's extras, and float8 where the run needs it
        user_args["EXTRAS"] = " ".join(dict.fromkeys(user_args["EXTRAS"].replace(",", " ").split()
                                                     + build_args.get("EXTRAS", "").split()))
    build_args.update(user_args)
    build_args["GIT_COMMIT"] = user_args.get("GIT_COMMIT") or (git_commit(root) if git else "unknown")
    dockerfile_text = dockerfile.read_text()
    digest = content_hash(dockerfile=dockerfile_text, build_args=build_args,
                          squash_options=image.squash_options, files=files, cache=cache)
    inputs = input_digests(dockerfile_text, files, cache)
    cache.save()
    h12 = digest[:12]
    tag = f"localhost/{image.name}:{h12}"
    context_dir = out / f".context-{h12}"
    squashfs = out / f"{image.name}-{h12}.sqsh"
    temp = out / f".{squashfs.name}.tmp-{_host()}-{os.getpid()}"
    if enroot_mount is None:
        enroot = Enroot.find()
        enroot_mount = enroot.supports_mount() if enroot else False
    plan = ImagePlan(
        name=image.name, hash=digest, tag=tag, root=root, output_dir=out, dockerfile=dockerfile, files=files,
        build_args=build_args, squash_options=image.squash_options, squashfs=squashfs, temp_squashfs=temp,
        link=out / f"{image.name}.sqsh", record=out / f"{image.name}.json",
        sidecar=out / f"{image.name}-{h12}.json", log=out / "logs" / f"{image.name}-{h12}.log",
        context_dir=context_dir,
        podman_argv=Podman.build_argv(tag=tag, dockerfile=dockerfile, context=context_dir, build_args=build_args,
                                      network_host=image.network_host, isolation=image.isolation, no_cache=force),
        enroot_argv=Enroot.import_argv(output=temp, uri=f"podman://{tag}", mount=enroot_mount),
        enroot_env=Enroot.import_env(image.squash_options), enroot_mount=enroot_mount,
        build_env=build_env(image.build_args), build_on=image.build_on, inputs=inputs,
    )
    if image.build_on == "compute":
        plan.frozen_config = out / f".build-{h12}.yaml"
    return plan


# ---------------------------------------------------------------- records


def _point_link(link: Path, target: Path) -> None:
    """Atomically make `link` a (relative) symlink to `target`."""
    if link.exists() and not link.is_symlink():
        raise ToolError(f"{link} is a regular file, not slipway's link to the current image: move it away "
                        f"(slipway keeps {link.name} as a symlink to {link.stem}-HASH.sqsh)")
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.replace(tmp, link)


def make_current(plan: ImagePlan, record: BuildRecord) -> None:
    write_atomic(plan.record, record.to_json())
    _point_link(plan.link, plan.squashfs)


def build_record(plan: ImagePlan, *, image_id: str | None, enroot_version: str | None) -> BuildRecord:
    return BuildRecord(
        name=plan.name, hash=plan.hash, tag=plan.tag, squashfs=str(plan.squashfs.resolve()),
        size_bytes=plan.squashfs.stat().st_size,
        built_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        base_image=plan.build_args.get("BASE_IMAGE"), git_commit=plan.build_args.get("GIT_COMMIT"),
        build_args=plan.build_args, build_env=plan.build_env, squash_options=plan.squash_options,
        inputs=plan.inputs, podman_image_id=image_id, enroot_version=enroot_version,
        enroot_mount=plan.enroot_mount)


def current_image(cfg: ImageConfig, *, root: Path | None = None) -> Optional[BuildRecord]:
    """The record of the current image (`OUTPUT_DIR/NAME.json`), or None."""
    root = (root or project_root()).resolve()
    return BuildRecord.read(resolve_path(root, cfg.image.output_dir) / f"{cfg.image.name}.json")


def resolve_image(cfg: ImageConfig, *, root: Path | None = None) -> Path | None:
    """The current squashfs as an absolute path with the link resolved, or None."""
    root = (root or project_root()).resolve()
    record = current_image(cfg, root=root)
    if record and Path(record.squashfs).is_file():
        return Path(record.squashfs).resolve()
    link = resolve_path(root, cfg.image.output_dir) / f"{cfg.image.name}.sqsh"
    return link.resolve() if link.is_file() else None


# ---------------------------------------------------------------- build and import


@dataclass
class ImageResult:
    plan: ImagePlan
    squashfs: Optional[Path]  # None with do_import=False
    built: bool  # podman build ran
    imported: bool  # enroot import ran
    seconds: float
    record: Optional[BuildRecord] = None
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: plan, build, import

    @property
    def size(self) -> int | None:
        return self.squashfs.stat().st_size if self.squashfs and self.squashfs.is_file() else None


_NO_SPACE = re.compile(r"no space left on device", re.I)


def _podman_build(plan: ImagePlan, podman: Podman, console: Console) -> None:
    materialize_context(plan.files, plan.context_dir, plan.build_env)
    tail = Tail(15)
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
                tail(line)
                if line.startswith("STEP "):
                    flush()
                    pending.append(line)
                elif line.startswith("--> Using cache"):
                    flush(" (cached)")
                else:
                    flush()
                    if "smoke ok" in line or line.startswith(("pip_requirements:", "flash-attn", "numactl",
                                                              "dependencies FAILED")):
                        console.print(f"    {escape(line)}", no_wrap=True, overflow="ellipsis", highlight=False)
                status.update(f"podman build: {escape(line[:100])}")

            rc = podman.build(plan.podman_argv, on_line)
            flush()
    finally:
        shutil.rmtree(plan.context_dir, ignore_errors=True)
    if rc != 0:
        console.print(tail.text(), style="red", highlight=False, markup=False)
        # The whole log, not the tail: a compiler's first error can be thousands of lines up.
        raise ToolError(diagnose_build(plan.log.read_text(errors="replace"), build_args=plan.build_args,
                                       log=plan.log, rc=rc))


def check_free_space(*, image_size: int, output_dir: Path, temp_dir: Path | None) -> None:
    """Room for the squashfs (about half the image) and, unless enroot mounts
    the image (`-x mount`), for the unpacked image in enroot's temp dir."""
    needs: dict[int, list] = {}
    for path, need, what in ((output_dir, int(image_size * SQUASH_RATIO), "the squashfs"),
                             (temp_dir, image_size, "the image unpacked by enroot")):
        if path is None:
            continue
        probe = path
        while not probe.exists():
            probe = probe.parent
        dev = probe.stat().st_dev
        entry = needs.setdefault(dev, [probe, 0, []])
        entry[1] += need
        entry[2].append(f"{what} in {path}")
    for probe, need, whats in needs.values():
        free = shutil.disk_usage(probe).free
        if free < need:
            raise ToolError(f"not enough disk for enroot import: ~{human(need)} needed for {' and '.join(whats)}, "
                            f"{human(free)} free: free space, set ENROOT_TEMP_PATH to a larger local disk, or "
                            "change image.output_dir")


def stale_temps(output_dir: Path, glob: str) -> list[Path]:
    """Leftovers of interrupted imports (`.NAME-HASH12.sqsh.tmp-HOST-PID`): this
    host's whose process is gone, or another host's older than a day."""
    host, stale = _host(), []
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


def _same_image(container: Container, tag: str, image_id: str | None) -> bool:
    bare = (image_id or "").removeprefix("sha256:")
    return container.image == tag or bool(bare) and container.image_id.removeprefix("sha256:") == bare


def _import_leftovers(podman: Podman, tag: str, before: set[str], printed: set[str]) -> list[Container]:
    """The stopped `enroot.*` containers this import left (see Enroot): new since the
    import began, created from our tag, and, when enroot printed container ids
    (`podman create` does), one of those: never another import's or another image's."""
    image_id = podman.image_id(tag)
    new = [c for c in podman.containers(Enroot.CONTAINER_FILTER)
           if c.id not in before and _same_image(c, tag, image_id) and c.state not in ("running", "paused")]
    return [c for c in new if c.id in printed] if printed else new


def _clean_import(plan: ImagePlan, podman: Podman, before: set[str] | None, printed: set[str],
                  console: Console) -> tuple[list[str], list[str]]:
    """Remove this import's leftover container(s): (removed names, warnings)."""
    if before is None:
        return [], []
    try:
        leftovers = _import_leftovers(podman, plan.tag, before, printed)
    except ToolError as exc:
        return [], [f"could not look for enroot's leftover podman container: {exc}"]
    removed, warnings = [], []
    for c in leftovers:
        outcome = podman.remove_container(c.id)
        if outcome:
            removed.append(c.name)
        else:
            warnings.append(f"could not remove enroot's leftover podman container {c.name} ({outcome.why}): it keeps "
                            f"{plan.tag} in use; `slipway image prune` retries")
    for warning in warnings:  # on one line, its suggestion as this shell runs slipway: pasted whole
        console.print(f"[yellow]warning:[/] {escape(as_typed(warning))}", highlight=False, soft_wrap=True)
    return removed, warnings


def _enroot_import(plan: ImagePlan, enroot: Enroot, podman: Podman, console: Console) -> list[str]:
    notes: list[str] = []
    size = podman.image_size(plan.tag)
    if size:
        check_free_space(image_size=size, output_dir=plan.output_dir,
                         temp_dir=None if plan.enroot_mount else Enroot.temp_dir())
    for stale in stale_temps(plan.output_dir, f".{plan.squashfs.name}.tmp-*"):
        stale.unlink(missing_ok=True)
    tmp = plan.temp_squashfs
    tmp.unlink(missing_ok=True)
    tail = Tail(40)
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
                    tail(line)
                    printed.update(_CONTAINER_ID.findall(line))
                    status.update(f"enroot import: {escape(line[:100])}")

                rc = enroot.import_(plan.enroot_argv, plan.enroot_env, on_line)
        finally:  # also after a failed or interrupted import: the container stays either way
            removed, warnings = _clean_import(plan, podman, before, printed, console)
            notes += [f"removed enroot's leftover podman container {name}" for name in removed] + warnings
        if rc != 0:
            # enroot can exit non-zero after a complete write: upstream's cleanup runs
            # `docker rm` (fails without docker), CSCS's has its own errors. Keep the
            # file only if its tables read back whole.
            if tmp.is_file() and squashfs_ok(tmp):
                why = " (its cleanup calls `docker rm`; slipway removed the container itself)" if removed else ""
                notes.append(f"enroot exited {rc} but the squashfs reads back whole: kept{why}")
                console.print(f"[yellow]note:[/] {escape(notes[-1])}", highlight=False)
            else:
                text = tail.text()
                if _NO_SPACE.search(text):
                    raise ToolError(f"enroot import ran out of disk: free space in {plan.output_dir} and "
                                    f"{Enroot.temp_dir()} (ENROOT_TEMP_PATH); log: {plan.log}")
                last = tail.lines[-1].strip()[:300] if tail.lines else ""
                raise ToolError(f"enroot import failed (exit {rc}): {last}; the podman image {plan.tag} is built, "
                                f"rerun to retry the import; log: {plan.log}")
        if not tmp.is_file():
            raise ToolError(f"enroot import exited {rc} without writing {tmp}; log: {plan.log}")
        os.replace(tmp, plan.squashfs)
    finally:
        tmp.unlink(missing_ok=True)
    return notes


def build_image(cfg: ImageConfig, *, force: bool = False, do_import: bool = True, console: Console | None = None,
                root: Path | None = None, here: bool = False,
                elsewhere: Optional[Callable[[ImagePlan], None]] = None) -> ImageResult:
    """Build (podman) and import (enroot) the image unless its squashfs exists.

    `force`: rebuild without podman's layer cache and reimport. `here`: build on
    this machine even when image.build_on is compute (what the srun runs).
    `elsewhere`: how an image.build_on: compute build runs (the Slurm side,
    jobs/cli/image.py, gives it; the inner build then runs here).
    """
    console = console or Console()
    t0 = time.perf_counter()
    plan = image_plan(cfg, root=root, force=force, do_import=do_import)
    # The build and the import both log there: the import alone runs when podman still has
    # the image but the output directory is new (images/ removed, image.output_dir changed).
    plan.log.parent.mkdir(parents=True, exist_ok=True)
    timings = {"plan": time.perf_counter() - t0}

    if do_import and plan.exists and not force:
        record = BuildRecord.read(plan.sidecar) or build_record(plan, image_id=None, enroot_version=None)
        if record.hash == plan.hash and record.inputs is None:
            # A record from before slipway stored its inputs: the same hash means the same inputs.
            record = dataclasses.replace(record, inputs=plan.inputs)
            write_atomic(plan.sidecar, record.to_json())
        current = BuildRecord.read(plan.record)
        if not current or current.hash != plan.hash or not plan.link.is_symlink() \
                or plan.link.resolve() != plan.squashfs.resolve():
            make_current(plan, record)
        console.print(f"image up to date: {plan.squashfs} ({human(plan.squashfs.stat().st_size)}, "
                      f"tag {plan.tag})", highlight=False, markup=False)
        return ImageResult(plan, plan.squashfs, built=False, imported=False, seconds=time.perf_counter() - t0,
                           record=record, timings=timings)

    if plan.build_on == "compute" and not here:
        if elsewhere is None:
            raise ToolError("image.build_on: compute builds through Slurm: run it with slipway image build CONFIG "
                            "(or set image.build_on: local)")
        elsewhere(plan)
        record = BuildRecord.read(plan.sidecar)
        return ImageResult(plan, plan.squashfs if plan.exists else None, built=True, imported=plan.exists,
                           seconds=time.perf_counter() - t0, record=record)

    podman = Podman.find()
    enroot = Enroot.find() if do_import else None
    if do_import and enroot is None:
        console.print("[yellow]warning:[/] enroot not found: the podman image will be built, the import skipped")
    for check in check_storage_conf():
        if not check.ok:
            console.print(f"[yellow]warning:[/] {escape(check.what)}: {escape(check.fix or '')}", highlight=False)

    built = False
    if force or not podman.image_exists(plan.tag):
        t1 = time.perf_counter()
        _podman_build(plan, podman, console)
        timings["build"] = time.perf_counter() - t1
        built = True
    else:
        console.print(f"podman image {plan.tag} exists: not rebuilding")
    if not do_import:
        console.print(f"[green]built[/] {plan.tag} ({time.perf_counter() - t0:.1f} s); import skipped (--no-import)")
        return ImageResult(plan, None, built=built, imported=False, seconds=time.perf_counter() - t0,
                           timings=timings)
    if enroot is None:
        raise ToolError(f"enroot not found: install enroot (https://github.com/NVIDIA/enroot) or run `make image` "
                        f"on a node that has it; the podman image {plan.tag} is built")

    t1 = time.perf_counter()
    notes = _enroot_import(plan, enroot, podman, console)
    timings["import"] = time.perf_counter() - t1
    record = build_record(plan, image_id=podman.image_id(plan.tag), enroot_version=enroot.version())
    write_atomic(plan.sidecar, record.to_json())
    make_current(plan, record)
    seconds = time.perf_counter() - t0
    console.print(f"[green]image ready[/]: {escape(str(plan.squashfs))} ({human(record.size_bytes)}) in "
                  f"{seconds:.0f} s; {escape(plan.link.name)} -> {escape(plan.squashfs.name)}", highlight=False)
    return ImageResult(plan, plan.squashfs, built=built, imported=True, seconds=seconds, record=record, notes=notes,
                       timings=timings)
