"""`slipway image build|show|prune|containers`. containers/ knows podman and enroot, not Slurm or runs:
a build on a compute node (image.build_on: compute) and the squashfs files runs pin (prune keeps them)
are given to it from here."""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from containers.image import ImagePlan, build_image, current_image, human, image_plan, next_steps
from containers.prune import prune_images
from containers.tools import ToolError, stream, which
from jobs.config import Config, dump_config, load_config
from jobs.slurm import srun_argv
from common.environ import project_dir
from common.fs import write_atomic


QUIET_S = 30  # `image containers`: a line at least this often while the nodes work


def _root(cfg: Config) -> Path:
    """The checkout the image commands act for: the one a submission from here builds its image
    from (containers.context.build_root), so that both name the same images and project."""
    from containers.context import build_root

    return build_root(project_dir(), cfg.image.dockerfile)


def compute_argv(cfg: Config, plan: ImagePlan, *, force: bool, do_import: bool) -> list[str]:
    """One srun that builds and imports on a compute node (podman storage on /dev/shm lives
    only as long as the allocation); the inner build reads the frozen config."""
    assert plan.frozen_config is not None
    s = cfg.slurm
    argv = srun_argv(nodes=1, cpus_per_task=s.cpus_per_task, time=s.time, account=s.account, partition=s.partition,
                     extra=["--job-name=slipway-image"])
    argv += [sys.executable, "-m", "jobs", "image", "build", "--here", str(plan.frozen_config)]
    return argv + (["--force"] if force else []) + ([] if do_import else ["--no-import"])


def build_on_compute(cfg: Config, plan: ImagePlan, console: Console, *, force: bool, do_import: bool) -> None:
    if which("srun") is None:
        raise ToolError("srun not found: image.build_on: compute builds through Slurm; run on a login node or set "
                        "image.build_on: local")
    argv = compute_argv(cfg, plan, force=force, do_import=do_import)
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    frozen = copy.deepcopy(cfg)
    frozen.image.build_on = "local"  # the inner build runs where it is
    try:
        write_atomic(plan.frozen_config, dump_config(frozen))
        console.print("[bold]srun[/] " + escape(shlex.join(argv[1:])), highlight=False)
        rc = stream([which("srun"), *argv[1:]], lambda line: console.print(line, highlight=False, markup=False),
                    cwd=plan.root)
    finally:
        plan.frozen_config.unlink(missing_ok=True)
    if rc != 0:
        raise ToolError(f"the image build on the compute node failed (srun exit {rc}): see the output above")


def build(cfg: Config, *, force: bool = False, do_import: bool = True, console: Console | None = None,
          root: Path | None = None, here: bool = False):
    """`slipway image build`: containers.build_image, with Slurm for image.build_on: compute."""
    console = console or Console()
    return build_image(cfg, force=force, do_import=do_import, console=console, root=root or _root(cfg), here=here,
                       elsewhere=lambda plan: build_on_compute(cfg, plan, console, force=force,
                                                               do_import=do_import))


def dry_run(cfg: Config, *, force: bool, do_import: bool, here: bool, console: Console) -> None:
    """`slipway image build --dry-run`: the steps a build would run, asking podman but running nothing."""
    plan = image_plan(cfg, root=_root(cfg), force=force)
    steps = next_steps(plan, force=force, do_import=do_import, here=here)
    lines = ([f"would run, for {plan.squashfs.name} (tag {plan.tag}):", *(f"  {step}" for step in steps)] if steps
             else [f"nothing to run: {plan.squashfs} exists (hash {plan.hash12}, tag {plan.tag})"])
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def prune(cfg: Config, *, keep: int, remove: list[str], console: Console, dry_run: bool):
    """`slipway image prune`: containers.prune_images, keeping every squashfs a run pins."""
    from jobs.runs import pinned_images

    root = _root(cfg).resolve()
    # Where runs live: the directory slipway's run commands use and the checkout the image is built from.
    project_dirs = list(dict.fromkeys([project_dir(), root]))
    return prune_images(cfg, keep=keep, root=root, remove=remove, console=console, dry_run=dry_run,
                        pinned=pinned_images(project_dirs))


def containers(cfg: Config, *, nodes: str | None, remove: bool, console: Console) -> int:
    """This project's unpacked pyxis containers left on the nodes (container.keep_builds, or a job's end
    that did not finish), never another project's: listed, or removed but for those a queued or running
    job uses, by the batch script's own sweep (jobs/slurm/pyxis_lib.sh), one srun task per node."""
    from jobs.slurm import hostnames, responding_nodes
    from jobs.slurm.script import PYXIS_LIB, PYXIS_PREFIX
    from containers.project import Project
    from common.errors import ConfigError

    if which("srun") is None:
        raise ToolError("srun not found: the containers are on the compute nodes; run this on a login node")
    names = hostnames(nodes) if nodes else responding_nodes(cfg.slurm.partition)
    if not names:
        raise ConfigError("--nodes", f"no responding node in partition {cfg.slurm.partition or '(any)'}: name the "
                                     "nodes with --nodes NODELIST")
    # The project whose name its jobs give their containers (jobs.runs.image.container_project).
    prefix = f"{PYXIS_PREFIX}{Project.of(_root(cfg)).token}-"
    sweep = f'sweep_containers "" "" "" 0 {"" if remove else "list"!r} {shlex.quote(prefix)}'
    # Each line as it comes (sed into a pipe would hold them back to the end), stderr's progress too.
    # Each node says itself that it has none, and why it cannot tell: never a silence read as none.
    script = (f'{PYXIS_LIB}\nnode=${{SLURMD_NODENAME:-$(hostname)}}\ncommand -v enroot >/dev/null || '
              '{ echo "$node: enroot is not on this node\'s PATH (the one this command runs with): its containers cannot be listed"; exit 1; }\n'
              f'{sweep} 2>&1 | {{ said=0; while IFS= read -r line; do said=1; printf "%s: %s\\n" "$node" "$line"; done; '
              '[ "$said" = 1 ] || echo "$node: none of this project\'s"; }')
    # --kill-on-bad-exit=0: a node that cannot tell must not cut another's answer short (KillOnBadExit=1 is common).
    argv = srun_argv(nodes=len(names), cpus_per_task=1, account=cfg.slurm.account, partition=cfg.slurm.partition,
                     kill_on_bad_exit=False, extra=[f"--nodelist={','.join(names)}", "--job-name=slipway-containers", "bash", "-c", script])
    console.print(f"[bold]{'removing' if remove else 'listing'}[/] slipway's pyxis containers on "
                  f"{escape(','.join(names))}", highlight=False)
    lines: list[str] = []

    def show(line: str) -> None:
        lines.append(line)
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    def alive(seconds: float) -> None:
        console.print(f"still {'removing' if remove else 'listing'} on {','.join(names)} ({seconds:.0f} s; deleting "
                      "an unpacked image takes minutes)", markup=False, highlight=False, soft_wrap=True)

    rc = stream([which("srun") or "srun", *argv[1:]], show, quiet=(QUIET_S, alive))
    if rc == 0 and not remove and any(": would remove " in line for line in lines):
        console.print(f"remove them with: slipway image containers {cfg.config_args}"
                      f"{' --nodes ' + shlex.quote(nodes) if nodes else ''} --remove", markup=False, highlight=False)
    return 0 if rc == 0 else 1


def _show(cfg, console: Console) -> None:
    plan = image_plan(cfg, root=_root(cfg))
    record = current_image(cfg, root=plan.root)
    project = f"{plan.project.id} ({plan.project.file})" if plan.project else f"none ({plan.project_error})"
    exists = f"exists, {human(plan.squashfs.stat().st_size)}" if plan.exists else "not built"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.enroot_env.items())
    lines = [("hash", plan.hash), ("project", project), ("tag", plan.tag), ("squashfs", f"{plan.squashfs} ({exists})"),
             ("current", f"{plan.link} -> {f'{record.squashfs} (hash {record.hash12})' if record else 'none'}"),
             ("context", f"{len(plan.files)} files")]
    if plan.build_env:
        build_env = " ".join(f"{k}={v}" for k, v in plan.build_env.items())
        lines.append(("buildenv", f"{build_env} (flash-attn compile; not hashed)"))
    lines += [("podman", shlex.join(plan.podman_argv)), ("enroot", f"{env} {shlex.join(plan.enroot_argv)}")]
    if plan.build_on == "compute":
        lines.append(("srun", shlex.join(compute_argv(cfg, plan, force=False, do_import=True))))
    for label, text in lines:
        console.print(f"{label:<9} {text}", highlight=False, markup=False, soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    """`slipway image COMMAND`, as jobs/cli/commands.py parsed it."""
    console = Console()
    try:
        base_image = getattr(args, "base_image", None)  # only build has --base-image
        cfg = load_config(args.config, args.overrides, {"image.base_image": base_image} if base_image else None) \
            if args.config else Config()
        if args.action == "build":
            if args.dry_run:
                dry_run(cfg, force=args.force, do_import=not args.no_import, here=args.here, console=console)
            else:
                build(cfg, force=args.force, do_import=not args.no_import, console=console, here=args.here)
        elif args.action == "show":
            _show(cfg, console)
        elif args.action == "containers":
            return containers(cfg, nodes=args.nodes, remove=args.remove, console=console)
        else:
            result = prune(cfg, keep=args.keep, remove=args.remove, console=console, dry_run=args.dry_run)
            if not result.ok:
                Console(stderr=True).print(f"[red]error:[/] prune could not remove {len(result.failed)} item(s), "
                                           "each listed above with the reason", highlight=False, soft_wrap=True)
                return 1
    except KeyboardInterrupt:
        Console(stderr=True).print("[red]interrupted[/]: no partial squashfs was left under a final name")
        return 130
    return 0
