"""Runs on this machine: `make local` (the same launch without Slurm) and `slipway shell`."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from plumbum import local

from jobs import runs, slurm
from jobs.config import Config
from jobs.sbatch import REQUEUE_EXIT, local_argv


def local_env(cfg: Config, run: runs.Run) -> dict[str, str]:
    """The batch script's environment, for a run on this machine."""
    env = {
        "PYTHONFAULTHANDLER": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cfg.launch.procs_per_node)),
        "SLIPWAY_RUN_DIR": str(run.dir),
        "HF_HOME": os.environ.get("HF_HOME", str(run.paths.project_dir / ".cache" / "huggingface")),
        "WANDB_MODE": os.environ.get("WANDB_MODE", "online") if os.environ.get("WANDB_API_KEY") else "offline",
    }
    for key, value in cfg.launch.env.items():
        env[key] = os.path.expandvars(value)
    return env


def _event(run: runs.Run, text: str) -> None:
    with (run.dir / "events.log").open("a") as f:
        f.write(f"{runs.now()} job local {text}\n")


def local_view(cfg: Config, *, rename: bool) -> tuple[Config, list[str]]:
    """`cfg` as it runs on this machine: the whole dp x tp x pp layout as processes of one
    node, on its CPUs (gloo), with this environment's Python and no container; what changed.

    A cluster config trained here gets its own run directory (`NAME-local`, unless the user
    named the run) so a trial never mixes its checkpoints into the cluster run's."""
    local = copy.deepcopy(cfg)
    changed = []
    world = cfg.parallel.world_size if not cfg.launch.command else cfg.world_size
    if cfg.slurm.nodes != 1 or cfg.launch.procs_per_node != world:
        changed.append(f"{cfg.slurm.nodes} node(s) x {cfg.launch.procs_per_node} -> 1 x {world} processes")
    if cfg.slurm.gpus_per_node:
        changed.append(f"{cfg.slurm.gpus_per_node} GPUs per node -> this machine's CPUs")
    if cfg.container.runtime != "none":
        changed.append(f"runtime {cfg.container.runtime} -> none (this environment's Python)")
    local.slurm.nodes, local.slurm.gpus_per_node = 1, 0
    local.launch.procs_per_node = world
    local.container.runtime = "none"
    local.launch.python = sys.executable
    if changed and rename:
        local.run.name = f"{cfg.run.name}-local"
    return local, changed


def run_local(cfg: Config, project_dir: Path, *, force: bool, console, rename: bool = True) -> int:
    """Create or resume the run directory and train here; the output also goes to logs/local-*.out."""
    cfg, changed = local_view(cfg, rename=rename)
    if changed:
        console.print(f"[dim]on this machine: {'; '.join(changed)}[/]", soft_wrap=True)
    run, created = runs.prepare_run(cfg, project_dir, force=force)
    argv = local_argv(cfg, run.paths)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    log_path = run.dir / "logs" / f"local-{stamp}.out"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    manifest = run.manifest()
    manifest.setdefault("submissions", []).append({"job_id": None, "local": True, "started": runs.now(),
                                                   "log": str(log_path.relative_to(run.dir)),
                                                   "git": runs.git_state(project_dir)})
    runs.write_atomic(run.dir / runs.MANIFEST, json.dumps(manifest, indent=2) + "\n")
    console.print(f"{'new run' if created else 'resuming run'} [bold]{cfg.run.name}[/] in {run.dir}", soft_wrap=True)
    console.print(f"[dim]$ {' '.join(argv)}[/]", soft_wrap=True)
    _event(run, "start on this machine")
    env = {**os.environ, **local_env(cfg, run)}
    with log_path.open("w") as log:
        proc = local[argv[0]][argv[1:]].popen(cwd=project_dir, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        try:
            for line in iter(proc.stdout.readline, b""):
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                log.write(line.decode(errors="replace"))
                log.flush()
        except KeyboardInterrupt:
            proc.wait()
        rc = proc.wait()
    _event(run, f"end exit {rc}")
    if rc == REQUEUE_EXIT:
        console.print("stopped after saving a checkpoint: run the same command again to resume")
    elif rc:
        console.print(f"[red]training failed with exit code {rc}[/]; log: {log_path}", soft_wrap=True)
    else:
        console.print(f"done: metrics in {run.dir / 'metrics.jsonl'}, checkpoints in {run.dir / cfg.checkpoint.dir}",
                      soft_wrap=True)
    return rc


def shell_argv(cfg: Config, project_dir: Path, command: list[str] | None = None) -> list[str]:
    """`srun ... --pty bash` in the image (or `command` without a pty), one node, one task."""
    s = cfg.slurm
    container: list[str] = []
    if cfg.container.runtime == "edf":
        from edf import Environment, write_edf

        env_toml = runs.runs_root(project_dir) / cfg.run.name / "env.toml"
        write_edf(Environment.from_container(cfg.container), env_toml, force=True)
        container = [f"--environment={env_toml}"]
    elif cfg.container.runtime == "pyxis":
        from edf import Environment, to_pyxis_args

        container = list(to_pyxis_args(Environment.from_container(cfg.container)).args)
    argv = slurm.srun_argv(nodes=1, ntasks_per_node=1, cpus_per_task=s.cpus_per_task, gpus_per_node=s.gpus_per_node,
                           time=s.time, account=s.account, partition=s.partition, pty=not command,
                           extra=container)
    return argv + (list(command) if command else ["bash"])


def exec_foreground(argv: list[str]) -> int:
    """Hand the terminal to `argv` and return its exit code."""
    if not slurm.available(argv[0]):
        raise slurm.SlurmError(f"{argv[0]} not found on PATH: run this on a Slurm login node")
    return local[argv[0]][argv[1:]].popen(stdin=None, stdout=None, stderr=None).wait()
