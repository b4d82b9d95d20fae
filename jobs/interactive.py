"""Launches started from the user's terminal: `slipway local` (the job's launch on this machine,
without Slurm) and `slipway run` (the batch script's steps inside an allocation); what they check
before any process starts is jobs/local_checks.py, their processes are watched over by
jobs/supervisor.py. `slipway shell` is jobs/shell.py."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Union

from rich.markup import escape
from rich.text import Text

from jobs import local_checks, runs, slurm, trainer_door
from jobs.runs import lock as runlock
from jobs.runs.code import git_state, prune_code_store
from jobs.runs.lifecycle import signal_name
from jobs.runs.container import create_needed_dirs, hf_home
from jobs.config import Config
from jobs.supervisor import FORWARDED, Heartbeat, Output, Stopper, oom_kills, stop_grace, wait_for_exit
from jobs.runs.manifest import Launch, Manifest
from jobs.slurm.ranks import local_argv
from common import environ
from common.errors import ConfigError
from common.events import append_event, now_iso
from common.rundir import HANG_EXIT, LOCAL_JOB, REQUEUE_EXIT, CodeSnapshot, HangLine, complete_checkpoints
from common.layouts import ALLOC_CONF, ALLOC_CONF_NAMES, PROCESS_BASE_BYTES, process_memory
from common.metrics_log import format_duration


def local_env(cfg: Config, run: runs.Run, code: Optional[CodeSnapshot] = None) -> dict[str, str]:
    """The batch script's environment, for a run on this machine (with its code snapshot's)."""
    env = {
        "PYTHONFAULTHANDLER": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(local_checks.rank_threads(cfg.launch.procs_per_node)),
        "SLIPWAY_RUN_DIR": str(run.dir),
        "HF_HOME": hf_home(cfg, run.paths),
        "WANDB_MODE": os.environ.get("WANDB_MODE", "online") if os.environ.get("WANDB_API_KEY") else "offline",
    }
    if not any(os.environ.get(name) or name in cfg.launch.env for name in ALLOC_CONF_NAMES):
        env[ALLOC_CONF_NAMES[0]] = ALLOC_CONF  # as the batch script: what the memory estimate assumes on a GPU
    for key, value in cfg.launch.env.items():
        env[key] = os.path.expandvars(value)
    if code is not None:
        env.update(code.environment(env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))))
    return env


def try_here(cfg: Config, project_dir: Path, *, force: bool, console, rename: bool = True, prepare: bool = False,
             reload: Optional[Callable[[list[str]], Config]] = None) -> tuple[runs.Sealed, local_checks.Plan]:
    """`cfg` as a try on this machine (its local view, sealed, nothing written) and its plan: every
    blocker at once, the command that clears them all, the expected time (measured here)."""
    local, changed = local_checks.local_view(cfg, rename=rename)
    if changed:
        console.print(f"[dim]on this machine: {'; '.join(changed)}[/]", soft_wrap=True)
    sealed = runs.seal(local, project_dir)
    speed, why = None, ("train.script or launch.command trains a model of its own" if local.launch.command or
                        local.train.script else "this machine's GPUs train it; the estimate and the memory check are "
                        "for CPUs" if local_checks.gpus_here() else "")
    if not why:
        console.print("[dim]measuring how fast this machine trains it (a few seconds)[/]", soft_wrap=True)
        speed, why = local_checks.measure(local)
    result = local_checks.plan(cfg, local, sealed, reload, force=force, prepare=prepare,
                               speed=speed, rename=rename)
    console.print(f"[dim]{escape(result.said or f'expected step time here: not known ({why})')}[/]", soft_wrap=True)
    return sealed, result


def run_local(cfg: Config, project_dir: Path, *, force: bool, console, rename: bool = True, yes: bool = False,
              prepare: bool = False, reload: Optional[Callable[[list[str]], Config]] = None) -> int:
    """Create or resume the run directory and train here (output also in logs/local-*.out). A try
    longer than LOCAL_TRY_SECONDS is asked about on a terminal once nothing else blocks it; the run's
    lock is held for the whole launch, so a second `local` or `submit` of the run is refused."""
    local, _ = local_checks.local_view(cfg, rename=rename)
    run_dir = runs.runs_root(project_dir) / local.run.name
    if busy := runlock.busy(run_dir):
        raise ConfigError("run.name", busy)
    if _finished(local, run_dir, "local", console):
        return 0
    sealed, result = try_here(cfg, project_dir, force=force, console=console, rename=rename, prepare=prepare,
                              reload=reload)
    asked = not yes and sys.stdin.isatty() and sys.stdout.isatty() and "train.steps" in {b.field for b in result.blockers}
    if [b for b in result.blockers if not (b.field == "train.steps" and (yes or asked))]:
        raise local_checks.Refused(result)
    if asked:
        console.print(f"[yellow]{escape(environ.as_typed('; '.join(result.lines())))}[/]", soft_wrap=True)
        try:
            answer = input("start it all the same? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            raise ConfigError("train.steps", "not started (nothing written): run the command above, or add --yes")
    if prepare and not sealed.data_status().prepared:  # then what its token counts say, before any process
        prepare_here(sealed, local_env(sealed.cfg, runs.Run(sealed.paths))["HF_HOME"], console)
        if blockers := local_checks.data_blockers(sealed, cfg, prepare=False):
            raise local_checks.Refused(local_checks.Plan(blockers))
    with runlock.hold(sealed.paths.path, f"slipway local {sealed.cfg.config_args}", trains=True):
        run, created = runs.prepare_run(sealed, force=force)
        return _train_here(run, sealed, project_dir, created, console, step_s=result.step_s, original=cfg)


def prepare_here(sealed: runs.Sealed, hf_home: str, console, num_proc: Optional[int] = None) -> None:
    """`slipway prepare` (and `local --prepare`) here: the sealed config's token cache, hub downloads in `hf_home`."""
    data = sealed.cfg.data
    os.environ["HF_HOME"] = hf_home  # before the hub libraries load
    console.print(f"preparing {data.dataset} with tokenizer {data.tokenizer} into {data.cache_dir}", soft_wrap=True)
    result = trainer_door.prepare(data, data.cache_dir, num_proc=data.num_proc if num_proc is None else num_proc,
                                  progress=console)
    for entry in result.entries:
        console.print(entry.describe(), soft_wrap=True, highlight=False)


def run_in_allocation(cfg: Config, project_dir: Path, *, force: bool, console) -> int:
    """`slipway run`: the run's batch script, as submit writes it, run inside the allocation this shell
    is in; rank 0's output on the terminal. Under pyxis the steps name their container by the
    allocation, so running again reuses it."""
    job, have = environ.allocation()
    salloc = f"`salloc --nodes={cfg.slurm.nodes} ...` first and run it in that shell, or `slipway submit {cfg.config_args}`"
    if not job:
        raise ConfigError("slipway run", f"not inside a Slurm allocation: {salloc}")
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
    if _finished(sealed.cfg, sealed.paths.path, "run", console):
        return 0
    if blockers := local_checks.data_blockers(sealed, cfg):
        raise local_checks.Refused(local_checks.Plan(blockers))
    with runlock.hold(sealed.paths.path, f"slipway run {cfg.config_args}", trains=True):
        create_needed_dirs(sealed.cfg, sealed.paths)  # a container's mount sources, as submit makes them
        run, created = runs.prepare_run(sealed, force=force)
        return _train_here(run, sealed, project_dir, created, console, allocation=job)


def _finished(cfg: Config, run_dir: Path, command: str, console) -> bool:
    """Whether the run already reached train.steps, said in one line: a complete run is no
    failure (exit 0), as for make's "nothing to be done"; `submit` refuses it, by the same rule."""
    if done := runs.nothing_to_train(cfg, run_dir, command):
        console.print(escape(done), soft_wrap=True)
    return done is not None


def _train_here(run: runs.Run, sealed: runs.Sealed, project_dir: Path, created: bool, console,
                allocation: Optional[str] = None, step_s: Optional[float] = None,
                original: Optional[Config] = None) -> int:
    cfg = sealed.cfg
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    if allocation:
        # The batch script itself; its events are this launch's ("local": the launcher's pid,
        # not Slurm, says whether it runs), its tag the allocation's (the steps' container).
        argv, tag = ["bash", str(run.paths.job_script)], allocation
        extra = {"SLIPWAY_IN_ALLOCATION": "1", "SLIPWAY_EVENT_JOB": LOCAL_JOB}
        log_path = run.paths.logs / f"run-{allocation}-{stamp}.out"
    else:
        argv = local_argv(cfg, run.paths, sealed.snapshot)
        tag = f"local-{stamp}"  # names this launch's files: its log, its hang dumps (trainer.watchdog.job_tag)
        extra = {**local_env(cfg, run, sealed.snapshot), "SLIPWAY_JOB_TAG": tag}
        log_path = run.paths.logs / f"{tag}.out"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    console.print(f"{'new run' if created else 'resuming run'} [bold]{cfg.run.name}[/] in {run.dir}", soft_wrap=True)
    if sealed.replaced:
        console.print(f"config replaced (--force): {escape(sealed.replaced)}", soft_wrap=True, highlight=False)
    console.print(f"[dim]$ {' '.join(argv)}[/]", soft_wrap=True)
    world = cfg.launch.procs_per_node * (1 if not allocation else cfg.slurm.nodes)
    console.print("[dim]" + ("the batch script's checks on every node, then its training step; rank 0's lines follow"
                             if allocation else f"starting {world} trainer processes: torchrun, then each imports "
                                                "torch and joins the process group (5 to 40 s); their lines follow")
                  + "[/]", soft_wrap=True)
    done = complete_checkpoints(run.dir / cfg.checkpoint.dir)
    compiling = cfg.train.compile is True or (cfg.train.compile == "auto" and bool(cfg.slurm.gpus_per_node))
    heartbeat = Heartbeat(run.dir, tag, world, step_s=step_s, compiling=compiling, resume_step=done[-1] if done else 0,
                          own=_own_program(cfg), steps=cfg.train.steps, checkpoints=run.dir / cfg.checkpoint.dir)
    ooms = oom_kills()
    rc, stopper, output, launch = _supervise(run, sealed, project_dir, argv, {**os.environ, **extra}, log_path,
                                             heartbeat, console, allocation, step_s)
    # A try past the bound of local_checks was started with --yes (or a yes): so is its resumption.
    left = cfg.train.steps - (done[-1] if done else 0)
    confirmed = " --yes" if not allocation and step_s and step_s * left > local_checks.LOCAL_TRY_SECONDS else ""
    command = escape(f"`{environ.invocation()} {'run' if allocation else 'local'} {cfg.config_args}{confirmed}`")
    end = _how_it_ended(run, cfg, tag, rc, stopper, output, _last_step(run, heartbeat), ooms, command, log_path,
                        bool(allocation))
    for text in end.events:
        append_event(run.dir, LOCAL_JOB, text)
    _finish_local(run, launch, end.outcome, **end.extra)
    said = end.lines
    if end.code == 0 and not allocation:
        said += _what_next(run, original or cfg)
    with contextlib.suppress(OSError), log_path.open("a") as log:  # the log ends as the terminal does
        log.writelines(f"slipway: {Text.from_markup(line).plain}\n" for line in said)
    with contextlib.suppress(OSError):  # a closed terminal (SIGHUP): the end is recorded all the same
        for line in said:
            console.print(line, soft_wrap=True, highlight=False)
    return end.code


def _supervise(run: runs.Run, sealed: runs.Sealed, project_dir: Path, argv: list[str], env: dict[str, str],
               log_path: Path, heartbeat: Heartbeat, console, allocation: Optional[str],
               step_s: Optional[float]) -> tuple[int, Stopper, Output, Launch]:
    """The launch started, recorded and watched until all of it has ended: (exit code, stopper, output, launch)."""
    cfg, outputs = sealed.cfg, []

    def notify(signum: int) -> None:
        if signum == signal.SIGINT:
            console.print(f"[yellow]Ctrl-C[/]: saving a checkpoint at the next step the ranks agree on, then stopping; "
                          f"a forced stop (unsaved) in {format_duration(stopper.grace_s)} ({stopper.grace_why}); "
                          "Ctrl-C again stops at once, unsaved", soft_wrap=True, highlight=False)
        for out in outputs:  # the log says it first: torch's and torchrun's lines about the exit follow
            out.note(f"{signal_name(signum)}: the ranks were asked to save a checkpoint at the step they agree on and "
                     f"stop (exit {REQUEUE_EXIT}: saved, resumable); what torch and torchrun report below about that "
                     "exit is this stop, not a failure")

    stopper = Stopper(run.dir, heartbeat.tag, agent=argv[1:3] == ["-m", "torch.distributed.run"],
                      leader_only=bool(allocation), notify=notify,
                      grace=lambda: stop_grace(run.dir, cfg.logging.interval, heartbeat.measured or step_s,
                                               cfg.launch.stop_grace))
    previous = {sig: signal.signal(sig, stopper.handle) for sig in FORWARDED}
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
            output = Output(proc.stdout, log, stopper, heartbeat, config_args=cfg.config_args)
            outputs.append(output)
            output.start()
            wait_for_exit(proc.pid)
            stopper.sweep()  # whatever of its session outlived it (the leader is not reaped yet: its group is ours)
            rc = proc.wait()
            stopper.done()
            output.join(timeout=10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return rc, stopper, output, launch


def _own_program(cfg: Config) -> str:
    """The user's own program a launch runs instead of slipway's trainer, named for the heartbeat."""
    if cfg.launch.command:
        return f"launch.command ({shlex.join(cfg.launch.command)[:60]})"
    return f"train.script {cfg.train.script}" if cfg.train.script else ""


def _what_next(run: runs.Run, original: Config) -> list[str]:
    """After a local run trained all its steps: its curves drawn, and the commands a user wants next."""
    try:
        curves = f"curves: {escape(str(trainer_door.plot([run.dir])))}"
    except ConfigError as exc:  # no matplotlib (the plot extra), no steps logged
        curves = f"curves not drawn: {escape(str(exc))}"
    name, prog = shlex.quote(run.name), environ.invocation()
    cluster = original.config_args_setting({"run.name": local_checks.free_name(original.run.name, run.dir, "cluster")})
    return [curves, escape(f"next: `{prog} status {name}` (this run and its launches); `{prog} watch {name}` (a run "
                           f"live, from a second terminal while it trains); `{prog} submit {cluster} --dry-run` (a "
                           "first cluster run, as a run of its own: what it would submit, nothing submitted)")]


@dataclass
class _End:
    """How a launch ended: exit code, the manifest's outcome (and `extra` fields), events, lines (markup)."""

    code: int
    outcome: Union[int, str]
    events: list[str]
    lines: list[str]
    extra: dict = field(default_factory=dict)


def _last_step(run: runs.Run, heartbeat: Heartbeat) -> Optional[int]:
    """The last step this launch completed, by rank 0's progress record or metrics.jsonl; None before either."""
    last, done = run.last_metrics(), heartbeat.progress()
    steps = ([last["step"]] if last and isinstance(last.get("step"), int) else []) + ([done[0]] if done else [])
    return max(steps) if steps else None


def _how_it_ended(run: runs.Run, cfg: Config, tag: str, rc: int, stopper: Stopper, output: Output,
                  step: Optional[int], ooms: Optional[int], command: str, log_path: Path, allocation: bool) -> _End:
    """What ended the launch, where, what was saved, the command that resumes it and the log (a line,
    two for a hang); `ooms`: `oom_kills` at the start. The batch script (`allocation`) records its own
    end and classifies a hang: the launcher only its code, unless a signal killed it."""
    own, log, where = not allocation or rc < 0, escape(str(log_path)), "" if step is None else f" at step {step}"
    steps = complete_checkpoints(run.dir / cfg.checkpoint.dir)
    start = f"{command} starts from step 0"
    resume = f"{command} resumes from its checkpoint at step {steps[-1]}" if steps else f"no checkpoint yet: {start}"
    signum = stopper.signum if own or rc == REQUEUE_EXIT else None
    if signum is not None:
        name = signal_name(signum)
        if stopper.forced is not None:
            told = (f": stopped after {format_duration(stopper.forced)}, unsaved: " + (
                f"the last checkpoint is step {steps[-1]}; {command} resumes from there" if steps else
                f"no checkpoint yet; {start}"))
        elif steps and steps[-1] == step:
            told = f" and saved it: {command} resumes from there"
        else:
            told = f", unsaved: {resume}" if steps else f" before its first checkpoint: {start}"
        what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"terminated by {name}"
        said = [f"[yellow]{what}[/]{where}{told}; log: {log}"]
        if not own:
            return _End(rc, rc, [], said)
        if signum == signal.SIGINT:
            return _End(128 + signum, "interrupted", [f"interrupted by {name} (Ctrl-C){where}", "end interrupted"],
                        said, {"signal": name})
        return _End(128 + signum, 128 + signum, [f"terminated by {name}{where}", f"end signal {name}"], said,
                    {"signal": name, "trainer_exit": rc})
    if own and (hang := _hang(run, cfg, tag)):  # its last line: what ended the run
        return _End(HANG_EXIT, HANG_EXIT, [hang, f"end exit {HANG_EXIT}"],
                    [f"log: {log}; {resume}", f"[red]{escape('hung: ' + hang.removeprefix('hang: '))}[/]"],
                    {"trainer_exit": rc})
    if own and (killed := -rc if rc < 0 else output.rank_signal):
        who = "the trainer" if rc < 0 or output.failed_rank is None else f"rank {output.failed_rank}"
        reason, oom = _killed(cfg, who, killed, where, ooms)
        return _End(128 + killed, 128 + killed, [reason, f"end exit {128 + killed}"],
                    [f"[red]{escape(reason)}[/]{'' if oom else f'; {resume}'}; log: {log}"], {"trainer_exit": rc})
    if rc == REQUEUE_EXIT:
        said = [f"stopped after saving a checkpoint: {resume}"]
    elif rc:
        said = [f"[red]training failed with exit code {rc}[/]{': ' + escape(output.error) if output.error else ''}; "
                f"log: {log}"]
    else:
        said = [escape(f"done: metrics in {run.dir / 'metrics.jsonl'}, checkpoints in {run.dir / cfg.checkpoint.dir}")]
    return _End(rc, rc, [f"end exit {rc}"] if own else [], said)


def _killed(cfg: Config, who: str, killed: int, where: str, ooms: Optional[int]) -> tuple[str, bool]:
    """Why signal `killed` ended the launch, and whether the out-of-memory killer sent it (its
    count moved since `ooms`): then with the batch that fits in half the memory it planned for."""
    name = signal_name(killed)
    if not (killed == signal.SIGKILL and ooms is not None and (oom_kills() or 0) > ooms):
        return f"{who} was killed by {name}{where}", False
    reason = f"{who} was killed by the out-of-memory killer ({name}){where}: this machine ran out of memory"
    if not (cfg.launch.command or cfg.train.script):  # half the arithmetic's batch-dependent part
        need = process_memory(cfg)
        reason += f"; {local_checks.smaller_batch(cfg, PROCESS_BASE_BYTES + (need - PROCESS_BASE_BYTES) / 2)}"
    return reason, True


def _hang(run: runs.Run, cfg: Config, tag: str) -> str:
    """The hang event of this launch from the dumps its ranks' watchdogs wrote, "" if none did."""
    dumps = run.paths.hang_dumps(tag)
    if not dumps:
        return ""
    first = HangLine.read(dumps[0])
    step, limit = (first.step, f"{first.limit_s:g}") if first else ("?", "?")
    return (f"hang: no step completed for {limit} s after step {step}; stack dumps from {len(dumps)} of "
            f"{cfg.world_size} ranks in {run.paths.hangs}/{tag}-*.txt")


def _record_local(run: runs.Run, log_path: Path, trainer_pid: int, project_dir: Path, sealed: runs.Sealed,
                  allocation: Optional[str] = None) -> Launch:
    """Add this launch to the manifest. Its `pid` is this process: it outlives the trainer and writes
    the outcome, so a reader never sees the launch dead before its exit is recorded."""
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
    """Record the launch's end: `exit` (its code, or "interrupted" for Ctrl-C) and `extra` (`signal`, `trainer_exit`)."""

    def finish(manifest: Manifest) -> None:
        for i in reversed(range(len(manifest.submissions))):
            if manifest.submissions[i].same(launch):
                manifest.submissions[i] = replace(manifest.submissions[i], ended=now_iso(), exit=outcome, **extra)
                break

    runs.update_manifest(run, finish)
