"""`slipway doctor`: preflight checks before burning an allocation, one line each with the fix."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from jobs import runs
from jobs.config import Config
from trainer.config import ConfigError


def _storage_conf() -> list[tuple[str, bool, str]]:
    from containers.storage import check_storage_conf

    return [("podman storage", c.ok, c.what + (f": {c.fix}" if c.fix else "")) for c in check_storage_conf()]


def checks(cfg: Config | None, project_dir: Path) -> list[tuple[str, bool, str]]:
    """(name, ok, detail or fix) for every check that applies."""
    out: list[tuple[str, bool, str]] = []
    for tool in ("sbatch", "srun", "squeue", "scontrol"):
        path = shutil.which(tool)
        out.append((tool, path is not None, path or f"{tool} not on PATH: run on a Slurm login node "
                                                      "(or `make cluster-up` for the local test cluster)"))
    runtime = cfg.container.runtime if cfg else None
    if runtime in (None, "edf", "pyxis"):
        podman = shutil.which("podman")
        out.append(("podman", podman is not None, podman or "podman not found: needed by `make image`"))
        if podman:
            out += _storage_conf()
        enroot = shutil.which("enroot")
        out.append(("enroot", enroot is not None, enroot or "enroot not found: `make image` builds the podman "
                                                           "image but cannot import it to squashfs here"))
    if cfg is None:
        return out
    out.append(("parallel layout", True, f"dp({cfg.parallel.dp}) x tp({cfg.parallel.tp}) x pp({cfg.parallel.pp}) = "
                                         f"{cfg.parallel.world_size} = nodes({cfg.slurm.nodes}) x "
                                         f"procs_per_node({cfg.launch.procs_per_node})"))
    try:
        runs.check_submittable(cfg)
        out.append(("image and mounts", True, cfg.container.image or "runtime none: no image"))
    except ConfigError as exc:
        out.append(("image and mounts", False, str(exc)))
    if runtime in ("edf", "pyxis"):
        try:
            from edf import Environment, parse_edf, render_edf, to_pyxis_args

            env = Environment.from_container(cfg.container)
            parse_edf(render_edf(env))
            if runtime == "pyxis":
                for warning in to_pyxis_args(env).warnings:
                    out.append(("pyxis flags", True, f"note: {warning}"))
            out.append(("EDF", True, "renders and parses back"))
        except ConfigError as exc:
            out.append(("EDF", False, str(exc)))
    if runtime == "edf" and shutil.which("srun"):
        out.append(("Container Engine", True, "srun --environment is used on the srun line (not in #SBATCH)"))
    if runtime == "none" and not os.access(cfg.launch.python, os.X_OK) and not shutil.which(cfg.launch.python):
        out.append(("python", False, f"launch.python {cfg.launch.python} is not executable here: run `make setup`"))
    elif runtime == "none":
        out.append(("python", True, cfg.launch.python))
    return out


def run_doctor(cfg: Config | None, project_dir: Path, console) -> int:
    results = checks(cfg, project_dir)
    for name, ok, detail in results:
        mark = "[green]ok  [/]" if ok else "[red]fail[/]"
        console.print(f"{mark} {name}: {detail}", soft_wrap=True)
    failed = sum(1 for _, ok, _ in results if not ok)
    console.print(f"{len(results) - failed} ok, {failed} failed")
    return 1 if failed else 0
