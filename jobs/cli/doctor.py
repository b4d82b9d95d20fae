"""`slipway doctor` (docs/runs.md): preflight checks of a config (what a submission of it would get) or
of a run (what its next job needs), one line each with the fix. Every check runs, whatever failed before."""

from __future__ import annotations

import os
import shlex
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from rich.markup import escape

from jobs import runs, slurm
from containers.record import BuildRecord
from edf import expand_host, parse_edf, resolve_base
from jobs.cli.gpu_stack import Result, gpu_stack
from jobs.config import Config
from jobs.runs.image import ImagePin
from jobs.config.sections import NODE_PRESETS
from common.rundir import RunDir
from common.environ import as_typed
from common.errors import ConfigError, bounded
from common.fs import existing_parent
from common.layouts import layout_advice


def _guard(name: str, check: Callable[[], list[Result]]) -> list[Result]:
    """A check's results, or its one-line error as a failure."""
    try:
        return check()
    except ConfigError as exc:
        return [(name, False, str(exc))]
    except (slurm.SlurmError, OSError) as exc:
        return [(name, False, " ".join(str(exc).split()))]


def _tools() -> list[Result]:
    out: list[Result] = [(tool, path is not None, path or f"{tool} not on PATH: run on a Slurm login node (or "
                                                          "`slipway cluster up` for a local test cluster)")
                         for tool in ("sbatch", "srun", "squeue", "scontrol") for path in [shutil.which(tool)]]
    if shutil.which("scontrol"):
        ok, said = slurm.ping()
        out.append(("slurm controller", ok, said if ok else controller_diagnosis(said)))
    return out


def controller_diagnosis(said: str) -> str:
    """One line: the fix first, then what `scontrol ping` said when no controller answered (cut
    short: with a local test cluster gone it is a page of munge errors)."""
    from jobs.devcluster import is_local_conf, spec_of_running

    conf, running = os.environ.get("SLURM_CONF"), spec_of_running()
    scontrol = f"(scontrol ping: {bounded(said, 160)})"
    if not conf and running is not None:
        return ("SLURM_CONF is not set, so Slurm's commands do not find the local test cluster that is up: run "
                f'`eval "$(slipway cluster env)"` in this shell first {scontrol}')
    if conf and is_local_conf(conf) and (running is None or str(running.conf) != conf):
        return (f"SLURM_CONF={shlex.quote(conf)} names a local test cluster that is not up (slipway cluster down "
                "stopped it): `unset SLURM_CONF` for this machine's own Slurm, or `slipway cluster up` and "
                f'`eval "$(slipway cluster env)"` again {scontrol}')
    return ("no Slurm controller answers, so sbatch would fail; check SLURM_CONF and that slurmctld runs "
            f"(`slipway cluster status` for a local test cluster) {scontrol}")


def controller_problem() -> str | None:
    """Why a submission now would fail at sbatch for want of a controller (None: one answers,
    or this machine has no scontrol to ask, where sbatch's own error says more)."""
    if not shutil.which("scontrol"):
        return None
    ok, said = slurm.ping()
    return None if ok else controller_diagnosis(said)


def _image_tools() -> list[Result]:
    podman = shutil.which("podman")
    out: list[Result] = [("podman", podman is not None, podman or "podman not found: needed by `make image`")]
    if podman:
        from containers.storage import check_storage_conf

        out += [("podman storage", c.ok, c.what + (f": {c.fix}" if c.fix else "")) for c in check_storage_conf()]
    enroot = shutil.which("enroot")
    out.append(("enroot", enroot is not None, enroot or "enroot not found: `make image` builds the podman "
                                                       "image but cannot import it to squashfs here"))
    return out


def _run_checks(cfg: Config, project_dir: Path) -> list[Result]:
    from jobs.runs.image import pin_image
    from jobs.runs.container import resolve_paths, run_environment, visibility_mounts

    paths = RunDir(runs.runs_root(project_dir) / cfg.run.name, project_dir.absolute())
    out: list[Result] = [("parallel layout", True, f"dp({cfg.parallel.dp}) x tp({cfg.parallel.tp}) x "
                                                   f"pp({cfg.parallel.pp}) = {cfg.parallel.world_size} = nodes("
                                                   f"{cfg.slurm.nodes}) x procs_per_node({cfg.launch.procs_per_node})")]
    if advice := layout_advice(cfg):  # the preset's published layout, when this one strays from it
        out.append(("parallel layout", True, f"note: {advice}"))
    out += _guard("mounts and files", lambda: (runs.check_submittable(cfg), [("mounts and files", True, "found")])[1])
    frozen = resolve_paths(cfg, paths)
    runtime = cfg.container.runtime

    def image() -> list[Result]:
        notes: list[str] = []
        pin = pin_image(frozen, paths.project, notes)
        if pin.source == "none":
            return [("image", True, "runtime none: no image")]
        detail = f"{pin.image} ({pin.source}{', build ' + pin.build_hash[:12] if pin.build_hash else ''})"
        return [("image", True, detail)] + [("image", True, f"note: {n}") for n in notes]

    def visible() -> list[Result]:
        added = visibility_mounts(frozen, paths)
        detail = ("mounted for the job: " + ", ".join(m.spec() for m in added)) if added else \
            "already mounted by container.mounts"
        return [("paths in the container", True, f"the run directory and the job's paths are visible at their own "
                                                 f"paths; {detail}")]

    def rendered() -> list[Result]:
        sealed = runs.seal(cfg, project_dir, dry_run=True)
        notes = [(("pyxis flags" if n.startswith("pyxis:") else "image"), True, f"note: {n}")
                 for n in sealed.notes if not n.startswith("a real submission would fail")]
        what = "batch script passes bash -n" + (", EDF renders and parses back" if runtime != "none" else "")
        return [("rendered files", True, what)] + notes

    out += _guard("image", image)

    def stack() -> list[Result]:
        pin = pin_image(frozen, paths.project)
        return gpu_stack(frozen, run_environment(frozen, paths, pin), pin)

    if cfg.slurm.gpus_per_node:  # an image that is not there is the image check's to say
        out += _guard("NCCL network", stack)
    if runtime in ("edf", "pyxis"):
        out += _guard("paths in the container", visible)
    out += _guard("rendered files", rendered)
    if runtime == "edf" and shutil.which("srun"):
        out.append(("Container Engine", True, "srun --environment is used on the srun line (not in #SBATCH)"))
    if runtime == "none":
        python = cfg.launch.python
        ok = os.access(python, os.X_OK) or shutil.which(python) is not None
        out.append(("python", ok, python if ok else f"launch.python {python} is not executable here: run "
                                                     "`make setup` or set launch.python"))
    return out


def _warm_ranks() -> list[Result]:
    """`slipway run`'s warm ranks, off where Slurm tracks processes by cgroup (jobs/slurm/job_lib.sh warm_up)."""
    by = ", ".join(f"{k}={v}" for k, v in slurm.cluster_config().items() if k in ("ProctrackType", "TaskPlugin") and "cgroup" in v)
    return [("warm ranks", True, f"note: off here, slipway run starts every rank cold: Slurm tracks processes by cgroup "
             f"({by}), where a forked rank would be its warm step's" if by else "slipway run starts its ranks from warm processes (launch.warm)")]


def _gres_gpus(gres: str) -> int:
    """GPUs in a node's generic resources as sinfo prints them (`gpu:4`, `gpu:a100:4(S:0-1)`)."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def cluster_checks(profile, cfg: Optional[Config] = None) -> list[Result]:
    """The profile against Slurm's own answers: partition, account and QoS, GPUs, MaxArraySize, EDF directory."""
    wanted = vars(cfg.slurm) if cfg is not None else profile.settings.get("slurm", {})
    preset = (cfg.launch.preset if cfg is not None else profile.settings.get("launch", {}).get("preset")) or "none"
    gpus = NODE_PRESETS[preset].gpus if preset in NODE_PRESETS else int(wanted.get("gpus_per_node") or 0)
    where = " or ".join(profile.sources) or "clusters.yaml"  # the file a fix goes in
    out: list[Result] = [(f"cluster {profile.name}", True, f"profile from {', '.join(profile.sources)}")]
    for what, check in (("partition", lambda: _partition(wanted.get("partition"), gpus, preset, where)),
                        ("account and QoS", lambda: _access(wanted.get("account"), wanted.get("qos"), where)),
                        ("MaxArraySize", _array_size),
                        ("EDF directory", lambda: _edf_dir(profile.cluster.edf_dir, where))):
        out += _guard(what, check)
    return out


def _partition(partition: Optional[str], gpus: int, preset: str, where: str) -> list[Result]:
    parts = slurm.partitions()
    default = partition or next(iter(parts), None)
    if partition and partition not in parts:
        return [("partition", False, f"slurm.partition {partition} is not a partition of this cluster (it has "
                                     f"{', '.join(parts) or 'none'}): fix it in {where}")]
    members = parts.get(default or "", [])
    found = [("partition", True, f"{default}: {len(members)} node(s)")]
    if gpus:
        carrying = [n for n, gres in members if _gres_gpus(gres) >= gpus]
        by = f"launch.preset {preset}" if preset in NODE_PRESETS else "slurm.gpus_per_node"
        found.append(("GPUs per node", bool(carrying), f"{len(carrying)} of {len(members)} node(s) of {default} "
                      f"carry the {gpus} GPUs {by} expects" if carrying else f"no node of {default} carries {gpus} "
                      f"GPUs (sinfo's gres: {', '.join(sorted({g for _, g in members})) or 'none'}): set "
                      f"slurm.partition to a GPU partition or lower slurm.gpus_per_node in {where}"))
    return found


def _access(account: Optional[str], qos: Optional[str], where: str) -> list[Result]:
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or ""
    assocs = slurm.associations(user)
    if assocs is None:
        return [("account and QoS", True, "note: this cluster runs no accounting (sacctmgr): not checked")]
    accounts = sorted({a for a, _ in assocs})
    found = []
    if account:
        found.append(("account", account in accounts, f"{account} is {user}'s" if account in accounts else
                      f"{user} has no association with account {account} (theirs: "
                      f"{', '.join(accounts) or 'none'}): fix slurm.account in {where}"))
    if qos:
        allowed = sorted({q for a, qs in assocs if not account or a == account for q in qs.split(",") if q})
        found.append(("QoS", qos in allowed, f"{qos} is allowed" if qos in allowed else
                      f"QoS {qos} is not among {user}'s ({', '.join(allowed) or 'none'}): fix slurm.qos in {where}"))
    return found


def _array_size() -> list[Result]:
    size = slurm.cluster_config().get("MaxArraySize", "")
    return [("MaxArraySize", size.isdigit(), f"{size}: a sweep of up to {int(size) - 1} points runs as one array"
             if size.isdigit() else "scontrol show config gave no MaxArraySize: is a controller answering?")]


def _edf_dir(directory: Optional[str], where: str) -> list[Result]:
    if not directory:
        return []
    import tempfile

    path = existing_parent(Path(directory))
    try:  # a file made and removed: permissions alone do not say (root, read-only mounts, /proc)
        with tempfile.TemporaryFile(prefix=".slipway-doctor-", dir=path):
            why = ""
    except OSError as exc:
        why = exc.strerror or str(exc)
    return [("EDF directory", not why, f"{directory} is writable" if not why else f"{directory} is not writable "
             f"here ({path}: {why}): fix cluster.edf_dir in {where} or the directory's permissions")]


def checks(cfg: Config | None, project_dir: Path, profile=None) -> list[Result]:
    """(name, ok, detail or fix) for every check that applies."""
    out = _tools()
    if cfg is None or cfg.container.in_container:
        out += _image_tools()
    if cfg is not None:
        out += _run_checks(cfg, project_dir)
    if cfg is not None and cfg.launch.warm and ("slurm controller", True) in [r[:2] for r in out]:
        out += _guard("warm ranks", _warm_ranks)
    if profile is not None and shutil.which("sinfo"):
        out += cluster_checks(profile, cfg)
    return out


def _merge_repeats(results: list[Result]) -> list[Result]:
    """One line per distinct problem: checks that fail on the same error (an unset variable in a
    mount stops the mounts, the container paths and the rendering alike) are named together."""
    out: list[Result] = []
    first: dict[str, int] = {}
    for name, ok, detail in results:
        if not ok and detail in first:
            i = first[detail]
            if name not in out[i][0].split(", "):
                out[i] = (f"{out[i][0]}, {name}", False, detail)
            continue
        if not ok:
            first[detail] = len(out)
        out.append((name, ok, detail))
    return out


def report(results: list[Result], console) -> int:
    """The results, each problem once, and the count; exit 1 where any failed."""
    results = _merge_repeats(results)
    for name, ok, detail in results:
        mark = "[green]ok  [/]" if ok else "[red]fail[/]"
        console.print(f"{mark} {escape(name)}: {escape(as_typed(detail))}", soft_wrap=True, highlight=False)
    failed = sum(1 for _, ok, _ in results if not ok)
    console.print(f"{len(results) - failed} ok, {failed} failed")
    return 1 if failed else 0


# ---------------------------------------------------------------- a run (`slipway doctor --run RUN`)


def _pinned_image(run: "runs.Run", pin: Optional[ImagePin]) -> list[Result]:
    """The file the run's next job (a requeue, a resubmission) runs: there, and as recorded."""
    if pin is None or pin.source == "none":
        return [("pinned image", True, "runtime none: no image")]
    path = pin.path
    if not path:
        return [("pinned image", True, f"{pin.image} (a registry image: not checked here)")]
    file = Path(path)
    resubmit = f"`slipway submit {shlex.quote(str(run.paths.config))}` resumes the run with the current one"
    if not file.is_file():
        return [("pinned image", False, f"{path} is gone (pruned or moved), so the run's next job (a requeue too) "
                                        f"fails to start: rebuild it (`{_rebuild(run)}` builds the same hash if the "
                                        f"sources are unchanged) or resubmit: {resubmit}")]
    st = file.stat()
    mtime = datetime.fromtimestamp(st.st_mtime, timezone.utc).isoformat(timespec="seconds")
    differs = [f"{what} {was} -> {now}" for what, was, now in (("size", pin.size, st.st_size),
                                                                ("mtime", pin.mtime, mtime))
               if was is not None and was != now]
    built = BuildRecord.beside(file)
    if pin.build_hash and built and built.hash != pin.build_hash:
        differs.append(f"build {pin.build_hash[:12]} -> {built.hash12}")
    if differs:
        return [("pinned image", False, f"{path} differs from what the run pinned ({', '.join(differs)}): "
                                        f"the next job runs other bytes; {resubmit}")]
    hash_ = f", build {pin.build_hash[:12]}" if pin.build_hash else ""
    return [("pinned image", True, f"{path} ({st.st_size} bytes, {mtime}{hash_}) as recorded")]


def _rebuild(run: "runs.Run") -> str:
    return f"slipway image build {shlex.quote(str(run.paths.config))}"


def _current_build(run: "runs.Run", pin: Optional[ImagePin]) -> list[Result]:
    """What the run's config would build now, against the build the run pinned."""
    from containers.context import build_root
    from containers.image import image_plan
    from jobs.runs.image import build_differences

    if pin is None or not pin.build_hash:
        return []
    cfg = run.config()
    if not cfg.container.in_container:
        return []
    plan = image_plan(cfg, root=build_root(run.paths.project, cfg.image.dockerfile), enroot_mount=False, git=False)
    if plan.hash == pin.build_hash:
        return [("current build", True, f"the run's config builds {plan.hash[:12]} now, the build it pinned")]
    # The record beside the squashfs outlives it when the file alone was deleted.
    built = BuildRecord.beside(Path(pin.path)) if pin.path else None
    differs = build_differences(built, plan, code_snapshot=cfg.code.snapshot)
    if not differs:
        return [("current build", True, f"the run's config builds {plan.hash[:12]} now; it differs from the pinned "
                                        f"{pin.build_hash[:12]} in code only, which the run's code snapshot brings: "
                                        "no rebuild needed")]
    return [("current build", True, f"note: the run's config would build {plan.hash[:12]} now, not the pinned "
                                    f"{pin.build_hash[:12]} ({'; '.join(differs)}): "
                                    f"`{_rebuild(run)}` builds it, a resubmission would pin it")]


def _run_mounts(run: "runs.Run") -> list[Result]:
    if not run.paths.env_toml.is_file():
        return [("mount sources", True, "no env.toml: the run uses no container")]
    env = parse_edf(run.paths.env_toml)
    if env.base_environment:
        env = resolve_base(env)
    missing = [src for i, mount in enumerate(env.mounts)
               if not Path(src := expand_host(mount.src, f"env.toml mounts[{i}]")).exists()]
    if missing:
        return [("mount sources", False, f"{', '.join(missing)} missing on this node: the next job fails to start; "
                                         "create them (or restore them), or resubmit with other container.mounts")]
    return [("mount sources", True, f"all {len(env.mounts)} exist on this node")]


def run_checks(run: "runs.Run") -> list[Result]:
    """(name, ok, detail or fix) for a run: what its next job needs from this node."""
    manifest = run.manifest()
    pin = manifest.image
    out: list[Result] = [("run", True, f"{run.dir} ({len(manifest.submissions)} submission(s))")]
    out += _guard("run config", lambda: [("run config", True,
                                          f"{run.paths.config} loads ({run.config().container.runtime})")])
    out += _guard("pinned image", lambda: _pinned_image(run, pin))
    out += _guard("pinned code", lambda: _pinned_code(run, manifest))
    out += _guard("current build", lambda: _current_build(run, pin))
    out += _guard("mount sources", lambda: _run_mounts(run))
    return out


def _pinned_code(run: "runs.Run", manifest) -> list[Result]:
    """The code snapshot and job libraries every node checks before the run's next job: here and unchanged."""
    from common.fs import file_sha256
    from jobs.runs.code import damage

    out: list[Result] = []
    resubmit = f"`slipway submit {shlex.quote(str(run.paths.config))}` writes them anew"
    code = manifest.code
    if code is None:
        out.append(("pinned code", True, "code.snapshot false: the image's own code"))
    else:
        why = damage(Path(code.dir), code.hash)
        out.append(("pinned code", why is None, f"snapshot {code.hash12} ({code.files} files) as submitted"
                    if why is None else f"{why}: the next job would end at its start; {resubmit}"))
    for name, digest in sorted(manifest.job_lib.items()):
        path = run.dir / name
        try:
            ok = file_sha256(path) == digest
            why = "" if ok else "differs from the one submitted"
        except OSError as exc:
            ok, why = False, f"cannot be read ({exc.strerror})"
        out.append(("job library", ok, f"{name} as submitted" if ok else f"{path} {why}: the next job would end "
                                                                          f"at its start; {resubmit}"))
    return out
