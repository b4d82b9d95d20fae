"""Launches started from the user's terminal: `slipway local` (the job's launch on this machine,
without Slurm), `slipway run` (the batch script's steps inside an allocation) and `slipway shell`.
Their processes are watched over by jobs/supervisor.py."""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Union

from plumbum import local
from rich.markup import escape

from edf import render_edf, srun_flags
from jobs import runs, slurm
from jobs.runs import lock as runlock
from jobs.runs.code import git_state, prune_code_store
from jobs.config import Config
from jobs.supervisor import FORWARDED, Output, Stopper, available_memory, oom_kills, wait_for_exit
from jobs.runs.manifest import Launch, Manifest
from jobs.slurm.ranks import local_argv
from common import environ
from common.errors import ConfigError
from common.fs import write_atomic
from common.events import append_event, now_iso
from common.rundir import HANG_EXIT, LOCAL_JOB, REQUEUE_EXIT, CodeSnapshot, HangLine, complete_checkpoints
from common.layouts import PROCESS_BASE_BYTES, fitting_batch, process_memory


def local_env(cfg: Config, run: runs.Run, code: Optional[CodeSnapshot] = None) -> dict[str, str]:
    """The batch script's environment, for a run on this machine (with its code snapshot's)."""
    env = {
        "PYTHONFAULTHANDLER": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cfg.launch.procs_per_node)),
        "SLIPWAY_RUN_DIR": str(run.dir),
        "HF_HOME": os.environ.get("HF_HOME", str(run.paths.project / ".cache" / "huggingface")),
        "WANDB_MODE": os.environ.get("WANDB_MODE", "online") if os.environ.get("WANDB_API_KEY") else "offline",
    }
    for key, value in cfg.launch.env.items():
        env[key] = os.path.expandvars(value)
    if code is not None:
        env.update(code.environment(env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))))
    return env


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
    """Create or resume the run directory and train here; the output also goes to logs/local-*.out.

    The run's lock is held for the whole launch: a second `slipway local` or `submit` of the
    run is refused while this one trains. SIGINT, SIGTERM and SIGHUP stop the trainer (see
    FORWARDED); the end is recorded, and nothing of the trainer's is left running."""
    cfg.container.require_host_env()  # the trainer takes them from this process's environment
    cfg, changed = local_view(cfg, rename=rename)
    check_fits_here(cfg)
    if changed:
        console.print(f"[dim]on this machine: {'; '.join(changed)}[/]", soft_wrap=True)
    sealed = runs.seal(cfg, project_dir)
    if _finished(sealed, "local", console):
        return 0
    check_before_start(sealed, cfg.config_args)  # seconds here, not after every process has started
    with runlock.hold(sealed.paths.path, f"slipway local {cfg.config_args}", trains=True):
        run, created = runs.prepare_run(sealed, force=force)
        return _train_here(run, sealed, project_dir, created, console)


def run_in_allocation(cfg: Config, project_dir: Path, *, force: bool, console) -> int:
    """`slipway run`: the run's batch script, as submit writes it, run here inside an existing
    allocation (salloc, or a shell on its first node): the same preflight, srun lines, container
    flags, run directory and events; rank 0's output on the terminal. Ctrl-C asks the ranks to
    save at the step boundary (the run stays resumable, exit 75); a second one stops them. Under
    pyxis the steps name their container by the allocation, so running again reuses it."""
    job = environ.job_id()
    salloc = f"`salloc --nodes={cfg.slurm.nodes} ...` first and run it in that shell, or `slipway submit {cfg.config_args}`"
    if not job:
        raise ConfigError("slipway run", f"not inside a Slurm allocation: {salloc}")
    have = environ.count("SLURM_JOB_NUM_NODES")
    have = environ.count("SLURM_NNODES") if have is None else have
    if have is not None and have < cfg.slurm.nodes:
        raise ConfigError("slurm.nodes", f"the run needs {cfg.slurm.nodes} nodes, allocation {job} has {have}: "
                                         f"salloc --nodes={cfg.slurm.nodes}, or run with --nodes {have}")
    tasks, cpus = (cfg.launch.procs_per_node if cfg.launcher == "srun" else 1), cfg.slurm.cpus_per_task or 1
    if (fewest := environ.fewest_cpus()) is not None and fewest < tasks * cpus:
        raise ConfigError("slurm.cpus_per_task", f"the run starts {tasks} task(s) x {cpus} CPU(s) per node, allocation "
                                                 f"{job} has {fewest} CPU(s) on a node: salloc --nodes={cfg.slurm.nodes} "
                                                 f"--ntasks-per-node={tasks} --cpus-per-task={cpus} (or --exclusive)")
    info = slurm.job_info(job)  # a shell left from an allocation that ended still says its id
    if info is None or info.state.split()[0] != "RUNNING":
        state = f"is {info.state.split()[0]}" if info is not None else "is unknown to Slurm"
        raise ConfigError("$SLURM_JOB_ID", f"allocation {job} {state}, not running: this shell is not inside a "
                                           f"live allocation; {salloc}")
    cfg.container.require_host_env()
    sealed = runs.seal(cfg, project_dir)
    if _finished(sealed, "run", console):
        return 0
    check_before_start(sealed, cfg.config_args)
    with runlock.hold(sealed.paths.path, f"slipway run {cfg.config_args}", trains=True):
        from jobs.runs.container import create_needed_dirs

        create_needed_dirs(sealed.cfg, sealed.paths)  # a container's mount sources, as submit makes them
        run, created = runs.prepare_run(sealed, force=force)
        return _train_here(run, sealed, project_dir, created, console, allocation=job)


def _finished(sealed: runs.Sealed, command: str, console) -> bool:
    """Whether the run already reached train.steps, said in one line: a complete run is no
    failure (exit 0), as for make's "nothing to be done"; `submit` refuses it, by the same rule."""
    done = runs.nothing_to_train(sealed.cfg, sealed.paths.path, command)
    if done:
        console.print(escape(done), soft_wrap=True)
    return done is not None


def _train_here(run: runs.Run, sealed: runs.Sealed, project_dir: Path, created: bool, console,
                allocation: Optional[str] = None) -> int:
    cfg = sealed.cfg
    code = sealed.snapshot
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    if allocation:
        # The batch script itself; its events are this launch's ("local": the launcher's pid,
        # not Slurm, says whether it runs), its tag the allocation's (the steps' container).
        argv = ["bash", str(run.paths.job_script)]
        tag = allocation
        extra = {"SLIPWAY_IN_ALLOCATION": "1", "SLIPWAY_EVENT_JOB": LOCAL_JOB}
        log_path = run.paths.logs / f"run-{allocation}-{stamp}.out"
    else:
        argv = local_argv(cfg, run.paths, code)
        tag = f"local-{stamp}"  # names this launch's files: its log, its hang dumps (trainer.watchdog.job_tag)
        extra = {**local_env(cfg, run, code), "SLIPWAY_JOB_TAG": tag}
        log_path = run.paths.logs / f"{tag}.out"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    console.print(f"{'new run' if created else 'resuming run'} [bold]{cfg.run.name}[/] in {run.dir}", soft_wrap=True)
    console.print(f"[dim]$ {' '.join(argv)}[/]", soft_wrap=True)
    env = {**os.environ, **extra}
    stopper = Stopper(run.dir, tag, agent=argv[1:3] == ["-m", "torch.distributed.run"],
                      leader_only=bool(allocation), notify=lambda signum: _say_stopping(console, signum))
    previous = {sig: signal.signal(sig, stopper.handle) for sig in FORWARDED}
    ooms = oom_kills()
    try:
        with log_path.open("w") as log:
            lock_fd = runlock.held_fd(run.dir)
            if not allocation:  # one a crashed launcher left would stop this one at its first step
                run.paths.stop_file.unlink(missing_ok=True)
            # The trainer inherits the run's lock: should this process be killed outright, the
            # run stays locked while its trainer trains.
            proc = subprocess.Popen(argv, cwd=project_dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    pass_fds=() if lock_fd is None else (lock_fd,))
            stopper.started(proc.pid)
            runlock.note(run.dir, trainer_pid=proc.pid)
            launch = _record_local(run, log_path, proc.pid, project_dir, sealed, allocation)
            if not allocation:  # the batch script says where it starts
                append_event(run.dir, LOCAL_JOB, "start on this machine")
            assert proc.stdout is not None
            output = Output(proc.stdout, log, stopper)
            output.start()
            wait_for_exit(proc.pid)
            stopper.sweep()  # whatever of its session outlived it (the leader is not reaped yet: its group is ours)
            rc = proc.wait()
            stopper.done()
            output.join(timeout=10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # The batch script records its own end (and classifies a hang); the launcher only its code.
    step = _last_step(run, tag)
    end = (_End(rc, rc, [], stopper.signum if rc == REQUEUE_EXIT else None) if allocation and rc >= 0
           else _how_it_ended(run, cfg, tag, rc, stopper.signum, output, step, ooms))
    for text in end.events:
        append_event(run.dir, LOCAL_JOB, text)
    _finish_local(run, launch, end.outcome, **end.extra)
    command = escape(f"`{environ.invocation()} {'run' if allocation else 'local'} {cfg.config_args}`")
    with contextlib.suppress(OSError):  # a closed terminal (SIGHUP): the end is recorded all the same
        _say_end(console, end, rc, step, command, log_path, run, cfg, output.error)
    return end.code


def _say_stopping(console, signum: int) -> None:
    if signum == signal.SIGINT:
        console.print("[yellow]Ctrl-C[/]: saving a checkpoint, then stopping (Ctrl-C again stops at once, unsaved)",
                      soft_wrap=True)


def _say_end(console, end: "_End", rc: int, step: Optional[int], command: str, log_path: Path, run: runs.Run,
             cfg: Config, error: str) -> None:
    """The end in one line (two for a hang): what ended the run, where, what was saved, the
    command that resumes it and the log."""
    log = escape(str(log_path))
    steps = complete_checkpoints(run.dir / cfg.checkpoint.dir)
    start = f"{command} starts from step 0"
    resume = f"{command} resumes from its checkpoint at step {steps[-1]}" if steps else f"no checkpoint yet: {start}"
    if end.signum is not None:
        what = "interrupted (Ctrl-C)" if end.signum == signal.SIGINT else f"terminated by {_signal_name(end.signum)}"
        where = "" if step is None else f" at step {step}"
        if steps and steps[-1] == step:
            told = f"{where} and saved it: {command} resumes from there"
        else:
            told = f"{where}, unsaved: {resume}" if steps else f"{where} before its first checkpoint: {start}"
        console.print(f"[yellow]{what}[/]{told}; log: {log}", soft_wrap=True)
    elif end.hang:
        console.print(f"log: {log}; {resume}", soft_wrap=True)
        console.print(f"[red]{escape(end.hang)}[/]", soft_wrap=True)  # the last line: what ended the run
    elif end.reason:
        console.print(f"[red]{escape(end.reason)}[/]{f'; {resume}' if end.resumable else ''}; log: {log}",
                      soft_wrap=True)
    elif rc == REQUEUE_EXIT:
        console.print(f"stopped after saving a checkpoint: {resume}", soft_wrap=True)
    elif rc:
        console.print(f"[red]training failed with exit code {rc}[/]{': ' + escape(error) if error else ''}; "
                      f"log: {log}", soft_wrap=True)
    else:
        console.print(f"done: metrics in {run.dir / 'metrics.jsonl'}, checkpoints in {run.dir / cfg.checkpoint.dir}",
                      soft_wrap=True)


@dataclass
class _End:
    """How a local launch ended: the launcher's exit code, the manifest's outcome and the events."""

    code: int
    outcome: Union[int, str]
    events: list[str]
    signum: Optional[int] = None
    hang: str = ""
    reason: str = ""
    resumable: bool = True  # the same command again is worth suggesting (not after running out of memory)
    extra: dict = field(default_factory=dict)


def _last_step(run: runs.Run, tag: str) -> Optional[int]:
    """The last step this launch completed: rank 0's progress record (about every second), or the
    last one it logged to metrics.jsonl; None before either."""
    last = run.last_metrics()
    steps = [last["step"]] if last and isinstance(last.get("step"), int) else []
    try:
        progress = json.loads(run.paths.progress.read_text())
        if isinstance(progress, dict) and progress.get("job") == tag and isinstance(progress.get("step"), int):
            steps.append(progress["step"])
    except (OSError, ValueError):
        pass
    return max(steps) if steps else None


def _how_it_ended(run: runs.Run, cfg: Config, tag: str, rc: int, signum: Optional[int], output: Output,
                  step: Optional[int], ooms: Optional[int]) -> _End:
    """`ooms`: the out-of-memory killer's count when the launch started (`oom_kills`)."""
    where = "" if step is None else f" at step {step}"
    if signum is not None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            return _End(128 + signum, "interrupted", [f"interrupted by {name} (Ctrl-C){where}", "end interrupted"],
                        signum, extra={"signal": name})
        return _End(128 + signum, 128 + signum, [f"terminated by {name}{where}", f"end signal {name}"], signum,
                    extra={"signal": name, "trainer_exit": rc})
    hang = _hang(run, cfg, tag)
    if hang:
        return _End(HANG_EXIT, HANG_EXIT, [hang, f"end exit {HANG_EXIT}"], hang=f"hung: {hang.removeprefix('hang: ')}",
                    extra={"trainer_exit": rc})
    killed = -rc if rc < 0 else output.rank_signal
    if killed:
        name = _signal_name(killed)
        who = "the trainer" if rc < 0 or output.failed_rank is None else f"rank {output.failed_rank}"
        reason = f"{who} was killed by {name}{where}"
        oom = killed == signal.SIGKILL and ooms is not None and (oom_kills() or 0) > ooms
        if oom:
            reason = f"{who} was killed by the out-of-memory killer ({name}){where}: this machine ran out of memory"
            if not (cfg.launch.command or cfg.train.script):  # half the arithmetic's batch-dependent part
                need = process_memory(cfg)
                reason += f"; {_smaller_batch(cfg, PROCESS_BASE_BYTES + (need - PROCESS_BASE_BYTES) / 2)}"
        return _End(128 + killed, 128 + killed, [reason, f"end exit {128 + killed}"], reason=reason,
                    resumable=not oom, extra={"trainer_exit": rc})
    return _End(rc, rc, [f"end exit {rc}"])


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _hang(run: runs.Run, cfg: Config, tag: str) -> str:
    """The hang event of this launch from the dumps its ranks' watchdogs wrote, "" if none did."""
    dumps = run.paths.hang_dumps(tag)
    if not dumps:
        return ""
    first = HangLine.read(dumps[0])
    step, limit = (first.step, f"{first.limit_s:g}") if first else ("?", "?")
    return (f"hang: no step completed for {limit} s after step {step}; stack dumps from {len(dumps)} of "
            f"{cfg.world_size} ranks in {run.paths.hangs}/{tag}-*.txt")


def check_fits_here(cfg: Config) -> None:
    """Slipway's trainer in `cfg`'s local view: refused before any process starts when the
    layout's arithmetic (common/layouts.py `process_memory`) needs more memory than this machine
    has free, naming the micro batch (else the sequence length) under which it fits."""
    available = available_memory()
    if cfg.launch.command or cfg.train.script or available is None:
        return
    world, need = cfg.launch.procs_per_node, process_memory(cfg)
    if world * need <= available:
        return
    said = (f"{world} processes of about {need / 1e9:.1f} GB each (common/layouts.py's arithmetic) need "
            f"{world * need / 1e9:.1f} GB, this machine has {available / 1e9:.1f} GB free")
    raise ConfigError("train.micro_batch_size", f"{said}: {_smaller_batch(cfg, FIT_SHARE * available / world)}")


# Of the memory free, what a suggested batch plans for: the arithmetic is within about 5% of a
# rank's peak, and the machine's other processes grow too.
FIT_SHARE = 0.8


def _smaller_batch(cfg: Config, budget: float) -> str:
    """The `slipway local` command whose processes stay within `budget` bytes each, and what it keeps."""
    fit = fitting_batch(cfg, budget)
    if fit is None:
        return "not even micro batch 1 at a short seq_len fits: try the layout on a smaller model or fewer processes"
    micro, accum, seq = fit
    settings = {"train.micro_batch_size": micro, "train.grad_accum_steps": accum}
    keeps = "the layout and the global batch"
    if seq != cfg.data.seq_len:
        settings["data.seq_len"], keeps = seq, f"the layout, at seq_len {seq} instead of {cfg.data.seq_len}"
    world = cfg.launch.procs_per_node * cfg.slurm.nodes
    return (f"`slipway local {cfg.config_args_setting(settings)}` keeps {keeps} "
            f"(~{world * process_memory(cfg, micro, seq) / 1e9:.1f} GB)")


def check_before_start(sealed: runs.Sealed, config_args: str) -> None:
    """What the trainer would refuse only once every process has started (torch imported, the
    process group formed), checked from the config and the token cache's index: files the run
    needs, a token cache `slipway prepare` has not made (the same refusal as `submit`), data too
    short for the sequence length or the validation share, a tokenizer larger than the model's
    vocabulary."""
    cfg = sealed.cfg
    runs.check_submittable(cfg)
    why = runs.unprepared_data(sealed, config_args)
    if why:
        raise ConfigError("data", why)
    _check_data_fits(cfg, sealed.data_status())


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


def _record_local(run: runs.Run, log_path: Path, trainer_pid: int, project_dir: Path, sealed: runs.Sealed,
                  allocation: Optional[str] = None) -> Launch:
    """Add this launch to the manifest. `pid` is this process, not the trainer's: it outlives the
    trainer and writes the outcome, so a reader never sees the launch dead before its exit is recorded."""
    launch = Launch(local=True, started=now_iso(), pid=os.getpid(), trainer_pid=trainer_pid,
                    host=socket.gethostname(), log=str(log_path.relative_to(run.dir)),
                    git=git_state(project_dir), code=sealed.snapshot, allocation=allocation or "",
                    steps=sealed.cfg.train.steps, job_lib=sealed.job_lib if allocation else {})

    def add(manifest: Manifest) -> None:
        runs.record_code(run, manifest, sealed, LOCAL_JOB)
        if allocation:  # the batch script ran, sourcing its libraries
            manifest.job_lib = sealed.job_lib
        manifest.submissions.append(launch)

    runs.update_manifest(run, add)
    prune_code_store(run.dir.parent)
    return launch


def _finish_local(run: runs.Run, launch: Launch, outcome: Union[int, str], **extra) -> None:
    """Record the launch's end: `exit` (its exit code, or "interrupted" for Ctrl-C), and `extra`
    (`signal`: the name of the signal that stopped it; `trainer_exit`: the trainer's own code)."""
    ended = now_iso()

    def finish(manifest: Manifest) -> None:
        for i in reversed(range(len(manifest.submissions))):
            if manifest.submissions[i].same(launch):
                manifest.submissions[i] = replace(manifest.submissions[i], ended=ended, exit=outcome, **extra)
                break

    runs.update_manifest(run, finish)




# Where the shell's EDF would be, as a dry run shows it (mkdtemp's Xs: a name chosen when it runs).
SHELL_EDF_SHOWN = "slipway-shell-XXXXXXXX"


def shell_argv(cfg: Config, project_dir: Path, command: list[str] | None = None, edf_dir: Path | None = None,
               write_code: bool = False) -> tuple[list[str], dict[str, str], str | None, list[str]]:
    """`srun ... --pty bash` in the image (or `command` without a pty), one node, one task;
    the variables to set in srun's environment (pyxis passes container.env that way); the
    text of the Container Engine's EDF (None for the other runtimes), to be written as
    `edf_dir`/env.toml (default: the name a dry run shows) before srun starts; and notes.

    The environment is the one a submitted run of `cfg` would get (pinned image, its paths
    mounted) less the paths not created yet, through the same `srun_flags` as the batch
    script; every mount source is checked here (jobs.runs.container.shell_environment). It never
    writes into a run directory. Variables of `container.env_from_host` are only named,
    never expanded: srun hands them on from this process's environment."""
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
    """What `slipway shell --dry-run` prints (the EDF, then the srun command), writing nothing;
    and its notes (what a real shell would refuse)."""
    notes = []
    try:
        cfg.container.require_host_env()
    except ConfigError as exc:
        notes.append(f"a real shell would fail: {exc}")
    argv, exports, text, shell_notes = shell_argv(cfg, project_dir, command)
    notes += shell_notes
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
        argv, exports, _, notes = shell_argv(cfg, project_dir, command, write_code=True)
        _shell_notes(notes)
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
        _shell_notes(notes)
        write_atomic(private / "env.toml", text or "", 0o600)
        return exec_foreground(argv, exports)
    finally:
        shutil.rmtree(private, ignore_errors=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _shell_notes(notes: list[str]) -> None:
    for note in notes:
        print(f"note: {note}", file=sys.stderr)


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_shell's cleanup


def exec_foreground(argv: list[str], exports: dict[str, str] | None = None) -> int:
    """Hand the terminal to `argv` (with `exports` added to its environment) and return its exit code."""
    if not slurm.available(argv[0]):
        raise slurm.SlurmError(f"{argv[0]} not found on PATH: run this on a Slurm login node")
    return local[argv[0]][argv[1:]].popen(stdin=None, stdout=None, stderr=None,
                                          env={**os.environ, **(exports or {})}).wait()
