"""Runs on this machine: `make local` (the same launch without Slurm) and `slipway shell`."""

from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from plumbum import local
from rich.markup import escape

from edf import render_edf, srun_flags
from jobs import runs, slurm
from jobs.config import Config
from jobs.sbatch import REQUEUE_EXIT, local_argv
from trainer.config import ConfigError
from trainer.fs import write_atomic


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
    local.launch.preset = "none"  # this machine is not the cluster's node type
    if changed and rename:
        local.run.name = f"{cfg.run.name}-local"
    return local, changed


def run_local(cfg: Config, project_dir: Path, *, force: bool, console, rename: bool = True) -> int:
    """Create or resume the run directory and train here; the output also goes to logs/local-*.out."""
    cfg.container.require_host_env()  # the trainer takes them from this process's environment
    cfg, changed = local_view(cfg, rename=rename)
    if changed:
        console.print(f"[dim]on this machine: {'; '.join(changed)}[/]", soft_wrap=True)
    sealed = runs.seal(cfg, project_dir)
    check_before_start(sealed, cfg.config_args)  # seconds here, not after every process has started
    run, created = runs.prepare_run(sealed, force=force)
    cfg = sealed.cfg
    argv = local_argv(cfg, run.paths)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    log_path = run.dir / "logs" / f"local-{stamp}.out"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    console.print(f"{'new run' if created else 'resuming run'} [bold]{cfg.run.name}[/] in {run.dir}", soft_wrap=True)
    console.print(f"[dim]$ {' '.join(argv)}[/]", soft_wrap=True)
    env = {**os.environ, **local_env(cfg, run)}
    interrupted, error = False, ""
    with log_path.open("w") as log:
        proc = local[argv[0]][argv[1:]].popen(cwd=project_dir, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT)
        launch = _record_local(run, log_path, proc.pid, project_dir)
        _event(run, "start on this machine")
        assert proc.stdout is not None
        try:
            for line in iter(proc.stdout.readline, b""):
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                text = line.decode(errors="replace")
                log.write(text)
                log.flush()
                if text.startswith("error: "):  # the trainer's one-line reason, restated below torchrun's report
                    error = text.removeprefix("error: ").strip()
        except KeyboardInterrupt:  # the terminal sent SIGINT to torchrun too: wait for it to stop
            interrupted = True
            try:
                proc.wait()
            except KeyboardInterrupt:  # a second Ctrl-C: do not wait any longer
                proc.kill()
        rc = proc.wait()
    _event(run, "end interrupted" if interrupted else f"end exit {rc}")
    _finish_local(run, launch, "interrupted" if interrupted else rc)
    steps = _checkpoint_steps(run.dir / cfg.checkpoint.dir)
    resume = (f"run the same command again to resume from its checkpoint at step {steps[-1]}" if steps else
              "no checkpoint was saved yet, so running the same command again starts from step 0")
    if interrupted:
        console.print(f"[yellow]interrupted[/] (Ctrl-C): {resume}; log: {log_path}", soft_wrap=True)
        return 130
    if rc == REQUEUE_EXIT:
        console.print(f"stopped after saving a checkpoint: {resume}", soft_wrap=True)
    elif rc:
        console.print(f"[red]training failed with exit code {rc}[/]{': ' + escape(error) if error else ''}; "
                      f"log: {log_path}", soft_wrap=True)
    else:
        console.print(f"done: metrics in {run.dir / 'metrics.jsonl'}, checkpoints in {run.dir / cfg.checkpoint.dir}",
                      soft_wrap=True)
    return rc


def check_before_start(sealed: runs.Sealed, config_args: str) -> None:
    """What the trainer would refuse only once every process has started (torch imported, the
    process group formed), checked from the config and the token cache's index: files the run
    needs, a token cache `slipway prepare` has not made (the same refusal as `submit`), data too
    short for the sequence length or the validation share, a tokenizer larger than the model's
    vocabulary, and a resumed run that already reached train.steps."""
    cfg = sealed.cfg
    runs.check_submittable(cfg)
    why = runs.unprepared_data(sealed, config_args)
    if why:
        raise ConfigError("data", why)
    _check_data_fits(cfg, sealed.data_status())
    steps = _checkpoint_steps(sealed.paths.run_dir / cfg.checkpoint.dir)
    if steps and steps[-1] >= cfg.train.steps:
        raise ConfigError("train.steps", f"run {cfg.run.name} already reached train.steps={cfg.train.steps} "
                                         f"(checkpoint at step {steps[-1]}): nothing to train; raise it "
                                         f"(--train-steps {steps[-1] + cfg.train.steps}) to train on, or pick "
                                         "another --run-name for a new run")


def _check_data_fits(cfg: Config, status) -> None:
    """The trainer's window and vocabulary rules (trainer/data.py), from the prepared entries'
    token counts; an entry the job will tokenize itself is judged there."""
    data, window = cfg.data, cfg.data.seq_len + 1
    index = {e.role: e.index for e in status.entries if e.prepared and e.index}
    if "train" not in index:
        return
    train = index["train"]
    n_train, source = int(train["n_tokens"]), train.get("source", data.dataset)
    if int(train.get("vocab_size", 0)) > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than the vocabulary of "
                                              f"data.tokenizer '{data.tokenizer}' ({train['vocab_size']}): set "
                                              f"model.vocab_size >= {train['vocab_size']}")
    if "validation" in index:
        n_val = int(index["validation"]["n_tokens"])
        if n_val < window:
            raise ConfigError("data.validation_split", f"{n_val:,} tokens of {index['validation'].get('source')} "
                                                       f"hold no window of data.seq_len + 1 = {window}: lower "
                                                       "data.seq_len or use more data")
    elif data.validation_fraction > 0 and not data.validation_split:
        n_val = int(n_train * data.validation_fraction)
        if n_val < window:
            raise ConfigError("data.validation_fraction",
                              f"{data.validation_fraction} of {n_train:,} tokens is {n_val}, less than one window "
                              f"of data.seq_len + 1 = {window}: raise it, lower data.seq_len, or set it to 0 to "
                              "skip validation")
        n_train -= n_val
    if n_train < window:
        raise ConfigError("data.dataset", f"{n_train:,} tokens of {source} hold no window of data.seq_len + 1 = "
                                          f"{window}: lower data.seq_len or use more data")


def _record_local(run: runs.Run, log_path: Path, trainer_pid: int, project_dir: Path) -> dict:
    """Add this launch to the manifest. `pid` is this process, not the trainer's: it outlives the
    trainer and writes the outcome, so a reader never sees the launch dead before its exit is recorded."""
    manifest = run.manifest()
    entry = {"job_id": None, "local": True, "started": runs.now(), "pid": os.getpid(), "trainer_pid": trainer_pid,
             "host": socket.gethostname(), "log": str(log_path.relative_to(run.dir)),
             "git": runs.git_state(project_dir)}
    manifest.setdefault("submissions", []).append(entry)
    runs.write_atomic(run.dir / runs.MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return entry


def same_launch(a: dict, b: dict) -> bool:
    """Whether two manifest entries are one local launch (a process may launch twice, as tests do)."""
    return bool(a.get("local")) and a.get("pid") == b.get("pid") and a.get("started") == b.get("started")


def _finish_local(run: runs.Run, launch: dict, outcome) -> None:
    manifest = run.manifest()
    for entry in reversed(manifest.get("submissions", [])):
        if same_launch(entry, launch):
            entry["ended"] = runs.now()
            entry["exit"] = outcome
            break
    runs.write_atomic(run.dir / runs.MANIFEST, json.dumps(manifest, indent=2) + "\n")


def local_state(entry: dict) -> tuple[str, str]:
    """(state, exit) of a local run's manifest entry, as `slipway status` shows it."""
    outcome = entry.get("exit")
    if outcome == "interrupted":
        return "INTERRUPTED", "130"
    if isinstance(outcome, int):
        state = "COMPLETED" if outcome == 0 else "STOPPED" if outcome == REQUEUE_EXIT else "FAILED"
        return state, str(outcome)
    pid, host = entry.get("pid"), entry.get("host")
    if pid and host == socket.gethostname():
        from trainer.fs import pid_alive

        # a killed launcher leaves its trainer training: the run is alive while either is
        alive = any(pid_alive(p) for p in (pid, entry.get("trainer_pid")) if p)
        return ("RUNNING", "") if alive else ("DIED", "")
    return ("UNKNOWN", "") if pid else ("ENDED", "")


def local_exit(state: str, code: str) -> int | None:
    """The exit code of a launch in `local_state` (state, code), as `watch` and `logs -f` exit with
    it: None while it runs, 1 for one that died without saying."""
    if state == "RUNNING":
        return None
    return int(code) if code.lstrip("-").isdigit() else 1


def local_elapsed(entry: dict) -> str:
    """How long a local run's launch ran (until now while it runs), as Slurm writes elapsed
    times ([D-]HH:MM:SS); empty when the manifest entry does not say."""
    if not entry.get("ended") and local_state(entry)[0] != "RUNNING":  # died: its end is unknown
        return ""
    try:
        start = datetime.fromisoformat(entry["started"])
        end = datetime.fromisoformat(entry["ended"]) if entry.get("ended") else datetime.now(timezone.utc)
    except (KeyError, TypeError, ValueError):
        return ""
    seconds = max(0, int((end - start).total_seconds()))
    days, rest = divmod(seconds, 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def _checkpoint_steps(ckpt_dir: Path) -> list[int]:
    """Complete checkpoints (the trainer's layout: step-NNNNNN/ with a COMPLETE marker), without torch."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in ckpt_dir.glob("step-*") if p.name[5:].isdigit()
                  and (p / "COMPLETE").is_file())




# Where the shell's EDF would be, as a dry run shows it (mkdtemp's Xs: a name chosen when it runs).
SHELL_EDF_SHOWN = "slipway-shell-XXXXXXXX"


def shell_argv(cfg: Config, project_dir: Path, command: list[str] | None = None,
               edf_dir: Path | None = None) -> tuple[list[str], dict[str, str], str | None]:
    """`srun ... --pty bash` in the image (or `command` without a pty), one node, one task;
    the variables to set in srun's environment (pyxis passes container.env that way); and the
    text of the Container Engine's EDF (None for the other runtimes), to be written as
    `edf_dir`/env.toml (default: the name a dry run shows) before srun starts.

    The environment is the one a submitted run of `cfg` would get (pinned image, its paths
    mounted), through the same `srun_flags` as the batch script. It never writes into a run
    directory. Variables of `container.env_from_host` are only named, never expanded: srun
    hands them on from this process's environment."""
    sealed = runs.seal(cfg, project_dir)
    env = sealed.env
    edf_file, text = None, None
    if env.runtime == "edf":
        text = render_edf(env)
        edf_file = (edf_dir or shell_edf_root(project_dir) / SHELL_EDF_SHOWN) / "env.toml"
    args, exports = srun_flags(env, edf_file).expanded()
    s = cfg.slurm
    argv = slurm.srun_argv(nodes=1, ntasks_per_node=1, cpus_per_task=s.cpus_per_task, gpus_per_node=s.gpus_per_node,
                           time=s.time, account=s.account, partition=s.partition, pty=not command, extra=args)
    return argv + (list(command) if command else ["bash"]), exports, text


def shell_edf_root(project_dir: Path) -> Path:
    """The parent of the shells' private EDF directories: beside the runs, on the filesystem
    the compute nodes share (the Container Engine reads the EDF there), never in a run."""
    return runs.runs_root(project_dir) / ".shell"


def shell_dry_run(cfg: Config, project_dir: Path, command: list[str] | None = None) -> tuple[str, list[str]]:
    """What `slipway shell --dry-run` prints (the EDF, then the srun command), writing nothing;
    and its notes (what a real shell would refuse)."""
    notes = []
    try:
        cfg.container.require_host_env()
    except ConfigError as exc:
        notes.append(f"a real shell would fail: {exc}")
    argv, exports, text = shell_argv(cfg, project_dir, command)
    out = ""
    if text is not None:
        edf_file = shell_edf_root(project_dir) / SHELL_EDF_SHOWN / "env.toml"
        out += f"==> {edf_file} (private, written when the shell starts, removed when it ends) <==\n{text}"
    return out + shlex.join([*(f"{k}={v}" for k, v in exports.items()), *argv]) + "\n", notes


def run_shell(cfg: Config, project_dir: Path, command: list[str] | None = None) -> int:
    """`slipway shell`: the Container Engine's EDF in a private directory (0700, the file 0600)
    for as long as srun runs, then removed (also on Ctrl-C, SIGTERM or a closed terminal)."""
    cfg.container.require_host_env()
    if cfg.container.runtime != "edf":
        argv, exports, _ = shell_argv(cfg, project_dir, command)
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
        argv, exports, text = shell_argv(cfg, project_dir, command, edf_dir=private)
        write_atomic(private / "env.toml", text or "", 0o600)
        return exec_foreground(argv, exports)
    finally:
        shutil.rmtree(private, ignore_errors=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_shell's cleanup


def exec_foreground(argv: list[str], exports: dict[str, str] | None = None) -> int:
    """Hand the terminal to `argv` (with `exports` added to its environment) and return its exit code."""
    if not slurm.available(argv[0]):
        raise slurm.SlurmError(f"{argv[0]} not found on PATH: run this on a Slurm login node")
    return local[argv[0]][argv[1:]].popen(stdin=None, stdout=None, stderr=None,
                                          env={**os.environ, **(exports or {})}).wait()
