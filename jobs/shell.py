"""`slipway shell`: an interactive `srun --pty bash` (or a command) in the image a submitted run
of the config would get, through the same container flags as the batch script."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Callable

from common.errors import ConfigError
from common.fs import write_atomic
from edf import render_edf, srun_flags
from jobs import runs, slurm
from jobs.config import Config
from jobs.slurm.client import tool


# Where the shell's EDF would be, as a dry run shows it (mkdtemp's Xs: a name chosen when it runs).
SHELL_EDF_SHOWN = "slipway-shell-XXXXXXXX"


def shell_argv(cfg: Config, project_dir: Path, command: list[str] | None = None, edf_dir: Path | None = None,
               write_code: bool = False) -> tuple[list[str], dict[str, str], str | None, list[str]]:
    """`srun ... --pty bash` (or `command`, no pty) on one node in a submitted run's environment, through
    the batch script's `srun_flags`; the variables srun's environment needs (pyxis passes container.env
    so; container.env_from_host is only named, srun hands it on); the Container Engine's EDF to write as
    `edf_dir`/env.toml before srun starts (None for the other runtimes); and notes."""
    from jobs.runs.container import shell_environment

    sealed = runs.seal(cfg, project_dir)
    code = sealed.snapshot if sealed.env.in_container else None  # runtime none: this checkout itself
    if code is not None and write_code:
        sealed.code.write()  # content-addressed, in the store beside the runs: never inside one
    env, notes = shell_environment(sealed.cfg, sealed.paths, sealed.pin, code)
    if code is not None and not write_code:
        notes.append(f"the checkout's code goes in as the code snapshot {code.dir} (written when the shell starts), "
                     "in front of the image's trainer, as a submission now would run it")
    edf_file, text = None, None
    if env.runtime == "edf":
        text = render_edf(env)
        edf_file = (edf_dir or shell_edf_root(project_dir) / SHELL_EDF_SHOWN) / "env.toml"
    args, exports = srun_flags(env, edf_file).expanded()
    s = cfg.slurm
    argv = slurm.srun_argv(nodes=1, cpus_per_task=s.cpus_per_task, gpus_per_node=s.gpus_per_node, time=s.time,
                           account=s.account, partition=s.partition, pty=not command, container=args)
    return argv + (list(command) if command else ["bash"]), exports, text, notes


def shell_edf_root(project_dir: Path) -> Path:
    """The parent of the shells' private EDF directories: beside the runs, on the filesystem
    the compute nodes share (the Container Engine reads the EDF there), never in a run."""
    return runs.runs_root(project_dir) / ".shell"


def shell_dry_run(cfg: Config, project_dir: Path, command: list[str] | None = None) -> tuple[str, list[str]]:
    """What `slipway shell --dry-run` prints (the EDF, then the srun command), and its notes."""
    argv, exports, text, notes = shell_argv(cfg, project_dir, command)
    try:
        cfg.container.require_host_env()
    except ConfigError as exc:
        notes.insert(0, f"a real shell would fail: {exc}")
    out = ""
    if text is not None:
        edf_file = shell_edf_root(project_dir) / SHELL_EDF_SHOWN / "env.toml"
        out += f"==> {edf_file} (private, written when the shell starts, removed when it ends) <==\n{text}"
    return out + shlex.join([*(f"{k}={v}" for k, v in exports.items()), *argv]) + "\n", notes


def run_shell(cfg: Config, project_dir: Path, say: Callable[[list[str]], None],
              command: list[str] | None = None) -> int:
    """`slipway shell`: the Container Engine's EDF in a private directory (0700, the file 0600) while srun
    runs, removed after (also on Ctrl-C, SIGTERM or a closed terminal); `say` tells the notes."""
    cfg.container.require_host_env()
    if cfg.container.runtime != "edf":
        argv, exports, _, notes = shell_argv(cfg, project_dir, command, write_code=True)
        say(notes)
        return exec_foreground(argv, exports)
    root = shell_edf_root(project_dir)
    runs.no_world_write()
    root.mkdir(parents=True, exist_ok=True)
    mode = root.stat()
    if mode.st_mode & 0o002 and mode.st_uid == os.getuid():  # whoever may write there could swap our directory
        os.chmod(root, mode.st_mode & 0o7775)
    private = Path(tempfile.mkdtemp(prefix=SHELL_EDF_SHOWN.rstrip("X"), dir=root))
    handlers = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        argv, exports, text, notes = shell_argv(cfg, project_dir, command, edf_dir=private, write_code=True)
        write_atomic(private / "env.toml", text or "", 0o600)
        say(notes)
        return exec_foreground(argv, exports)
    finally:
        shutil.rmtree(private, ignore_errors=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_shell's cleanup


def exec_foreground(argv: list[str], exports: dict[str, str]) -> int:
    """Hand the terminal to `argv` (with `exports` added to its environment); its exit code."""
    return tool(argv[0])[argv[1:]].popen(stdin=None, stdout=None, stderr=None, env={**os.environ, **exports}).wait()
