"""`slipway watch RUN` (docs/runs.md): a live view of a run's job until it ends, from the run directory
(metrics.jsonl's end, rank 0's progress.json, each node's heartbeats/NODE and gutil/NODE.gutil, events.log)
and from Slurm (one squeue, or sacct once slurmctld forgot the job; none once events.log tells its end),
or for a launch on this machine from its launcher's process. Ctrl-C stops watching, not the job."""

from __future__ import annotations

import contextlib
import shlex
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from jobs import runs, slurm
from jobs.cli.logs import JobPoll, job_arg
from jobs.runs import lifecycle
from jobs.runs.manifest import Launch
from jobs.slurm.script import NODE_HEARTBEAT_SECONDS
from common.environ import as_typed
from common.errors import ConfigError, one_line
from common.fs import read_json, read_tail
from common.metrics_log import format_duration
from common.events import Event, EventKind
from common.rundir import LOCAL_JOB

EVENTS_SHOWN = 8
GUTIL_TAIL_BYTES = 64 << 10  # the latest samples of up to 8 GPUs, many times over
PROGRESS_BYTES = 64 << 10
LOCAL = LOCAL_JOB  # the job id events.log gives launches on this machine
_RED = lifecycle.FAILURE_KINDS | {EventKind.CANCELLED}
_YELLOW = frozenset({EventKind.RETRY, EventKind.TIME_LIMIT_REQUEUE, EventKind.TIME_LIMIT_WARNING,
                     EventKind.TIME_LIMIT_STOP})


@dataclass
class NodeView:
    name: str
    heartbeat_age: Optional[float] = None  # seconds; None: none yet
    gpus: int = 0
    sm_percent: Optional[float] = None  # mean over the node's GPUs
    memory_gib: Optional[float] = None  # framebuffer in use, summed


@dataclass
class Snapshot:
    """What one frame shows."""

    run: str
    job_id: str
    # The job's state word and reason: Slurm's while the job runs, the run's lifecycle's once it ended.
    state: lifecycle.LaunchState
    where: str = ""  # its nodes (Slurm's nodelist), or the host of a launch on this machine
    elapsed: str = ""
    total_steps: Optional[int] = None
    metrics: dict = field(default_factory=dict)
    step_age: Optional[float] = None  # seconds since the last completed step
    progress_step: Optional[int] = None
    hang_timeout: Optional[float] = None
    nodes: list[NodeView] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    ended: bool = False


def parse_gutil(path: Path) -> tuple[int, Optional[float], Optional[float]]:
    """(GPUs, mean SM %, framebuffer GiB in use) from the latest sample of each GPU in an
    `nvidia-smi dmon --options DT` file; columns are found by the header line's names."""
    try:  # the end only: nvidia-smi dmon appends a line per GPU every few seconds for days
        data = read_tail(path, GUTIL_TAIL_BYTES)
    except OSError:  # a FIFO or a device among them is no sample
        return 0, None, None
    lines = [] if data is None else data.decode(errors="replace").splitlines()[-400:]
    columns: list[str] = []
    latest: dict[str, dict[str, str]] = {}  # each GPU's latest sample, by column
    for line in lines:
        words = line.lstrip("#").split()
        if line.startswith("#"):
            columns = words if "gpu" in words else columns
        elif columns and len(words) == len(columns):
            latest[words[columns.index("gpu")]] = dict(zip(columns, words))

    def number(row: dict[str, str], name: str) -> Optional[float]:
        try:
            return float(row.get(name, ""))
        except ValueError:  # "-": not measured, or no such column
            return None

    sm = [v for r in latest.values() if (v := number(r, "sm")) is not None]
    fb = [v for r in latest.values() if (v := number(r, "fb")) is not None]
    return len(latest), (sum(sm) / len(sm) if sm else None), (sum(fb) / 1024 if fb else None)


def _age(path: Path, now: float) -> Optional[float]:
    try:
        return max(0.0, now - path.stat().st_mtime)
    except OSError:
        return None


def latest_job(run: runs.Run) -> str:
    """The run's latest training job; LOCAL when its latest launch was on this machine."""
    launches = run.launches()
    if not launches:
        raise ConfigError("RUN", f"run {run.name} has no job to watch: `slipway submit {shlex.quote(str(run.paths.config))}` "
                                 "submits it")
    if launches[-1].local:
        return LOCAL
    # Its latest training job, or its preparation job where it has none yet.
    return next((x.id for x in reversed(launches) if x.kind == "train" and not x.local), launches[-1].id)


class Watcher:
    """Builds snapshots of one job; remembers what it needs between polls."""

    def __init__(self, run: runs.Run, job_id: str):
        self.run, self.job_id = run, job_id
        self._poll = JobPoll(run, job_id)
        self._launch: Optional[Launch] = None  # the local launch watched: the latest when watching began
        self._hosts: dict[str, list[str]] = {}
        self.total_steps: Optional[int] = run.total_steps()

    def snapshot(self) -> Snapshot:
        now = time.time()
        state, where, elapsed, ended = self._local() if self.job_id == LOCAL else self._slurm()
        if ended and state.state == lifecycle.COMPLETED:  # a completion needs no reason
            state = replace(state, reason="")
        snap = Snapshot(self.run.name, self.job_id, state, where, elapsed, total_steps=self.total_steps, ended=ended)
        snap.metrics = self.run.last_metrics() or {}
        self._progress(snap, now)
        events = self.run.events()
        snap.events = events[-EVENTS_SHOWN:]
        if self.job_id != LOCAL:  # each `make local` is a launch of its own, not an attempt of one job
            self._nodes(snap, now)
            snap.history = lifecycle.history(self.job_id, events).lines()
        return snap

    def _slurm(self) -> tuple[lifecycle.LaunchState, str, str, bool]:
        """(state, nodes, elapsed, ended) of the job."""
        state, info, ended = self._poll()
        return state, info.nodes if info else "", info.elapsed if info else "", ended

    def _local(self) -> tuple[lifecycle.LaunchState, str, str, bool]:
        launches = [x for x in self.run.launches() if x.local]
        if self._launch is None and launches:
            self._launch = launches[-1]
        launch = next((x for x in reversed(launches) if self._launch and x.same(self._launch)), None)
        if launch is None:
            return lifecycle.LaunchState(lifecycle.UNKNOWN), "", "", True
        state = self.run.state(launch)
        shown = state if state.ended else replace(state, reason="")  # its start event is no reason to show
        return shown, launch.host, lifecycle.elapsed(launch, state), state.ended

    def _progress(self, snap: Snapshot, now: float) -> None:
        # A few hundred bytes, rewritten whole at each step: more is no progress file.
        progress = read_json(self.run.paths.progress, PROGRESS_BYTES) or {}
        # A record in metrics.jsonl is written once a step completed: its last write bounds the
        # age too (the only figure for a trainer without the watchdog).
        ages = [_age(self.run.paths.metrics, now)]
        if isinstance(progress.get("unix"), (int, float)):
            ages.append(max(0.0, now - progress["unix"]))
            snap.progress_step = progress.get("step") if isinstance(progress.get("step"), int) else None
            timeout = progress.get("hang_timeout")
            snap.hang_timeout = timeout if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else None
        known = [a for a in ages if a is not None]
        snap.step_age = min(known) if known else None

    def _nodes(self, snap: Snapshot, now: float) -> None:
        nodelist = snap.where
        if nodelist and not snap.ended and nodelist not in self._hosts:  # an ended job's: its heartbeats name them
            self._hosts[nodelist] = slurm.hostnames(nodelist)
        names = self._hosts.get(nodelist) or sorted(p.name for p in self.run.paths.heartbeats.glob("*"))
        for name in names:
            node = NodeView(name, _age(self.run.paths.node_heartbeat(name), now))
            node.gpus, node.sm_percent, node.memory_gib = parse_gutil(self.run.paths.node_gutil(name))
            snap.nodes.append(node)


def _fmt_age(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{format_duration(seconds)} ago"


def render(snap: Snapshot):
    """The frame (no I/O); every string from a file, Slurm or a job escaped by one_line."""
    state = snap.state
    state_style = {"RUNNING": "green", "PENDING": "yellow", "COMPLETED": "green"}.get(state.state.split()[0], "red")
    head = Text.assemble(("run ", "dim"), (one_line(snap.run), "bold"), ("  job ", "dim"),
                         (one_line(snap.job_id), "bold"), "  ", (one_line(state.state), f"bold {state_style}"))
    if state.reason:
        head.append(f" ({one_line(state.reason)})", style="yellow")
    if snap.where:
        head.append(f"  on {one_line(snap.where)}")
    if snap.elapsed:
        head.append(f"  elapsed {snap.elapsed}", style="dim")
    parts = [head, _training_row(snap), *[Text(one_line(h), style="dim") for h in snap.history],
             *([_nodes_table(snap)] if snap.nodes else []), _events_table(snap)]
    if snap.ended:
        parts.append(Text(one_line(f"job {snap.job_id} ended: {state.state}, exit code {state.final_exit}"),
                          style="bold green" if state.final_exit == 0 else "bold red"))
    return Group(*parts)


def _training_row(snap: Snapshot):
    m = snap.metrics
    steps = [s for s in (m.get("step"), snap.progress_step) if isinstance(s, int)]
    step = max(steps) if steps else None  # progress.json is ahead between logged steps
    train = Table.grid(padding=(0, 2))  # add_row makes its columns
    mfu, tps, loss, age = m.get("mfu"), m.get("tokens_per_s"), m.get("loss"), snap.step_age
    age_style = "red" if (age is not None and snap.hang_timeout and age > snap.hang_timeout / 2) else ""
    train.add_row(
        Text(f"step {step if step is not None else '-'}/{snap.total_steps or '?'}", style="bold"),
        f"loss {loss:.4f}" if isinstance(loss, (int, float)) else "loss -",
        f"{tps:,.0f} tokens/s" if isinstance(tps, (int, float)) else "tokens/s -",
        f"MFU {100 * mfu:.1f}%" if isinstance(mfu, (int, float)) else "MFU n/a",
        f"ETA {format_duration(m.get('eta_s') if isinstance(m.get('eta_s'), (int, float)) else None)}",
        Text(f"last step {_fmt_age(age)}", style=age_style),
        Text(f"hang_timeout {snap.hang_timeout:g} s", style="dim") if snap.hang_timeout else "",
    )
    return train


def _nodes_table(snap: Snapshot):
    nodes = Table("node", "heartbeat", "GPUs", "GPU use", "GPU memory", title="nodes", title_justify="left",
                  show_edge=False, pad_edge=False)
    stale = 2 * NODE_HEARTBEAT_SECONDS + 5
    for n in snap.nodes:
        beat = Text(_fmt_age(n.heartbeat_age),
                    style="red" if n.heartbeat_age is None or n.heartbeat_age > stale else "green")
        nodes.add_row(Text(one_line(n.name)), beat, str(n.gpus) if n.gpus else "-",
                      f"{n.sm_percent:.0f}%" if n.sm_percent is not None else "-",
                      f"{n.memory_gib:.1f} GiB" if n.memory_gib is not None else "-")
    return nodes


def _events_table(snap: Snapshot):
    events = Table(title="events", title_justify="left", show_header=False, show_edge=False, pad_edge=False)
    events.add_column(no_wrap=True, style="dim")
    events.add_column()
    for event in snap.events:
        stamp = when.strftime("%H:%M:%S") if (when := event.when) else one_line(event.time)
        kind = event.kind
        style = "red" if kind in _RED or (kind in (EventKind.END, EventKind.PREPARE_END) and event.exit_code) else \
            "yellow" if kind in _YELLOW else ""
        events.add_row(Text(stamp), Text(one_line(f"job {event.job} {event.text}"), style=style))
    return events


def watch(run: runs.Run, job_id: Optional[str] = None, *, interval: float = 2.0, once: bool = False,
          console=None) -> int:
    """The job live until it ends; its exit code (`once`: one frame, exit 0). Into a pipe or a file: a
    frame at once, then one each time the step, the events or the job's state change."""
    console = console or Console(highlight=False)
    watcher = Watcher(run, job_arg(run, job_id) or latest_job(run))
    snap = watcher.snapshot()
    if once:
        console.print(render(snap))
        return 0
    live, shown = (Live(console=console, auto_refresh=False) if console.is_terminal else None), None
    try:
        with live or contextlib.nullcontext():
            while True:
                if live is not None:
                    live.update(render(snap), refresh=True)
                elif _changes(snap) != shown:
                    console.print(render(snap))
                    shown = _changes(snap)
                if snap.ended:
                    return snap.state.final_exit
                time.sleep(interval)
                snap = watcher.snapshot()
    except KeyboardInterrupt:
        goes_on = ("the run goes on (Ctrl-C in its own terminal stops it)" if watcher.job_id == LOCAL else
                   f"job {watcher.job_id} goes on (`slipway cancel {run.name}` ends it)")
        console.print(one_line(as_typed(f"stopped watching; {goes_on}")), highlight=False, markup=False, soft_wrap=True)
        return 130


def _changes(s: Snapshot) -> tuple:
    return s.metrics.get("step"), s.progress_step, len(s.events), s.state.state, s.ended
