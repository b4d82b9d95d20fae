"""The supervisor of a launch from the terminal (`slipway local`, `slipway run`, jobs/interactive.py):
stopping its processes when asked, and what of their output reaches the terminal (docs/runs.md).

A stop is asked of the ranks, never of torchrun: the ranks save at the step they agree on and exit
(trainer/loop.py StopSignal), while torchrun would signal them itself and kill them after its
shutdown timeout. The stop file (RunDir.stop_file) tells ranks not started yet. Every line goes to
the log; what torch and torchrun say of processes ending (`Noise`) stays off the terminal.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from common.edge import DEBUG_VARIABLE
from common.environ import as_typed
from common.metrics_log import format_duration
from common.errors import one_line
from common.events import append_event
from common.fs import read_json, read_tail
from common.rundir import LOCAL_JOB, RunDir, SaveLine

# Signals that stop a launch (a closed terminal's SIGHUP forwarded as SIGTERM, Slurm's stop signal).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The least time the ranks' save gets after the first signal before all is killed (`stop_grace`).
STOP_GRACE_SECONDS = 90.0
STOP_TELL_SECONDS = 10.0  # while a stop waits, a line this often says for what


def stop_grace(run_dir: Path, sync_steps: int, step_s: Optional[float], setting: Optional[float]) -> tuple[float, str]:
    """Seconds a stop waits for the ranks' save, and why: launch.stop_grace, else twice the steps to
    the next sync step (at `step_s`, else the last save's step time) and a save as long as the last."""
    if setting is not None:
        return setting, "launch.stop_grace"
    lines = (read_tail(RunDir(run_dir).saves, 1 << 16) or b"").decode(errors="replace").splitlines()
    last = next((save for line in reversed(lines) if (save := SaveLine.parse(line))), SaveLine(0, 0, 0, 0, ""))
    step_s = step_s or last.step_ms / 1000
    sync = f" ({sync_steps} to a sync step)" if sync_steps > 1 else ""
    return max(STOP_GRACE_SECONDS, 2 * ((sync_steps + 1) * step_s + last.ms / 1000) + 30), (
        f"its ~{format_duration(step_s, fine=True)} steps{sync}" + (f" and ~{format_duration(last.ms / 1000)} saves"
                                                                    if last.at else ", no save yet")
        + "; launch.stop_grace sets it")


class Stopper:
    """This process's handler of FORWARDED: the first signal asks the launch to stop, a second one,
    or the grace later, kills all of it: every process whose environment names its run directory
    and tag (torchrun starts each rank in a session of its own, so its process group is not all)."""

    def __init__(self, run_dir: Path, tag: str, *, agent: bool = False, leader_only: bool = False,
                 notify: Callable[[int], None] = lambda signum: None,
                 grace: Callable[[], tuple[float, str]] = lambda: (STOP_GRACE_SECONDS, "")) -> None:
        # agent: the launch's first process is torchrun, whose children are the ranks.
        # leader_only (`slipway run`): the batch script alone gets the signal; its trap asks the
        # ranks to save and stop, and srun and the ranks (other nodes' too) are its to stop.
        self.run_dir, self.agent, self.leader_only, self.notify = run_dir, agent, leader_only, notify
        self.grace, self.grace_s, self.grace_why = grace, STOP_GRACE_SECONDS, ""
        self.asked: Optional[float] = None  # when the first signal came (monotonic)
        self.forced: Optional[float] = None  # seconds after it, when the grace ran out and it killed the launch
        self.signum: Optional[int] = None
        self.pgid: Optional[int] = None
        self.stop_file = RunDir(run_dir).stop_file
        self._marks = {f"SLIPWAY_RUN_DIR={run_dir}".encode(), f"SLIPWAY_JOB_TAG={tag}".encode()}
        self._killer: Optional[threading.Timer] = None

    def handle(self, signum: int, _frame) -> None:
        first = self.signum is None
        if first:
            self.signum, self.asked = signum, time.monotonic()
            with contextlib.suppress(Exception):  # a measurement that fails keeps the least grace
                self.grace_s, self.grace_why = self.grace()
            with contextlib.suppress(Exception):  # a closed terminal: the stop goes on all the same
                self.notify(signum)
        if self.pgid is None:
            return  # not started yet: `started` forwards it
        if first:
            self._forward()
        else:
            self.kill()

    def started(self, pid: int) -> None:
        self.pgid = pid  # a session leader: its pid is its process group's id
        if self.signum is not None:
            self._forward()

    def _forward(self) -> None:
        assert self.signum is not None and self.pgid is not None
        sig = signal.SIGTERM if self.signum == signal.SIGHUP else self.signum
        if not self.leader_only:
            with contextlib.suppress(OSError):
                self.stop_file.touch()
        for pid in [self.pgid] if not self.agent else self.ranks():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        self._killer = threading.Timer(self.grace_s, self.force)
        self._killer.daemon = True
        self._killer.start()

    def processes(self) -> list[int]:
        """The pids of this launch's processes (those readable: this user's)."""
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    env = set(f.read().split(b"\0"))
            except OSError:  # gone, or not ours
                continue
            if self._marks <= env:
                found.append(int(entry.name))
        return found

    def ranks(self) -> list[int]:
        """torchrun's children: the ranks (not their own children, a data loader's workers)."""
        ranks = []
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == self.pgid:
                ranks.append(pid)
        return ranks

    def kill(self) -> None:
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def force(self) -> None:
        self.forced = time.monotonic() - (self.asked or time.monotonic())
        self.kill()

    def sweep(self) -> None:
        """Kill what remains once the launch's first process has exited (a rank torchrun left behind)."""
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            self.kill()
            time.sleep(0.05)
        self.kill()  # the group's members left behind by a rank that no longer names the launch

    def done(self) -> None:
        if self._killer is not None:
            self._killer.cancel()
        if not self.leader_only:  # the batch script removes its own
            with contextlib.suppress(OSError):
                self.stop_file.unlink(missing_ok=True)


def wait_for_exit(pid: int) -> None:
    """Until process `pid` has exited, not reaping it: its pid keeps naming its process group, so the
    sweep never reaches another's. Signal handlers run meanwhile (PEP 475 resumes the wait)."""
    with contextlib.suppress(ChildProcessError):
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


_RANK = re.compile(r"^\[rank(\d+)\]:\s?")  # torch's prefix of a rank's traceback lines
# torch's own log lines (glog's format): torchrun's agent `W1125 16:25:57.555000 30359 torch/...py:753]`, C++
# `[W1125 16:30:03.123456789 socket.cpp:464]` (`[rank0]:[W...` once the process group names the rank)
_TORCH_LOG = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+(?: +\d+)? \S+:\d+\]")
_CPP_LOG = re.compile(r"^\[[IWEF] \S+\.(?:cpp|h|hpp|cc):\d+\]")  # older C++ warnings: [W socket.cpp:663]
_CPP_TRACE = re.compile(r"^(frame #\d+: |Exception raised from |terminate called |  what\(\): |\(no backtrace)")
_WARM = re.compile(r"^slipway-warm (\S+): (rank \d+|the node step) (?:started warm\b.*|starts cold: (.*))$")  # trainer/warm.py
_BOX = re.compile(r"^={20,}\s*$")  # torchrun's failure report sits between two such lines
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")
_DELIBERATE = ("KeyboardInterrupt", "SystemExit", "torch.distributed.elastic.multiprocessing.api.SignalException",
               "torch.distributed.elastic.multiprocessing.errors.ChildFailedError")


class Noise:
    """`shown(line)`: False for torch's and torchrun's own lines (tracebacks, the failure report, log
    lines, C++ frames). `exception` ("rank R: Type: message"): the last traceback's, a crash's reason."""

    def __init__(self) -> None:
        self.exception = ""
        self._traceback: set[Optional[str]] = set()  # the ranks (None: unprefixed) inside a Python traceback
        self._box = False  # inside torchrun's failure report

    def shown(self, line: str) -> bool:
        match = _RANK.match(line)
        rank, text = (match.group(1), line[match.end():]) if match else (None, line)
        body = text.rstrip("\n")
        if self._box or _BOX.match(body):  # a rule opens torchrun's failure report, the next closes it
            self._box = self._box != bool(_BOX.match(body))
            return False
        if body.startswith("Traceback (most recent call last):"):
            self._traceback.add(rank)
            return False
        if rank in self._traceback:
            if not body.strip() or body[:1].isspace() or body.startswith(_CHAIN):
                return False
            self._traceback.discard(rank)  # the exception line ends it
            if not body.startswith(_DELIBERATE):
                self.exception = f"rank {rank}: {body}" if rank is not None else body
            return False
        if match and not body.strip():
            return False
        return not (_TORCH_LOG.match(body) or _CPP_LOG.match(body) or _CPP_TRACE.match(body))


# A launch silent this long says what it is waiting for: never a silent half minute.
HEARTBEAT_SECONDS = 20.0
SLOW_FACTOR = 1.5  # steps this many times slower than expected are said, with the new total


class Heartbeat:
    """What a silent launch waits for, from its output, config and rank 0's progress record."""

    def __init__(self, run_dir: Path, tag: str, procs: int, *, step_s: Optional[float] = None,
                 compiling: bool = False, resume_step: int = 0, own: str = "", steps: int = 0,
                 checkpoints: Optional[Path] = None) -> None:
        # own: a program of the user's (train.script, launch.command), whose phases slipway cannot tell
        self.run_dir, self.tag, self.procs, self.step_s = run_dir, tag, procs, step_s
        self.compiling, self.resume_step, self.own = compiling, resume_step, own
        self.steps, self.checkpoints = steps, checkpoints or run_dir / "checkpoints"
        self.started = time.monotonic()
        self.first: Optional[tuple[int, float]] = None  # the first step seen done, and when
        self.measured: Optional[float] = None  # the mean step since then
        self.slow_said = False

    def pace(self) -> str:
        """Once, a line when the steps since the first (the warm-up) take over SLOW_FACTOR times the expected."""
        done = self.progress()
        if done is None:
            return ""
        self.first = self.first or done
        if done[0] - self.first[0] < 2:
            return ""
        self.measured = (done[1] - self.first[1]) / (done[0] - self.first[0])
        if self.slow_said or not self.step_s or self.measured <= SLOW_FACTOR * self.step_s:
            return ""
        self.slow_said, left = True, max(0, self.steps - done[0])
        return (f"slower than expected: ~{format_duration(self.measured, fine=True)} a step here, not the "
                f"~{format_duration(self.step_s, fine=True)} measured before the start: ~"
                f"{format_duration(self.measured * left)} for the {left} steps left")

    def stopping(self, stopper: "Stopper") -> str:
        """What a stop waits for: the step in progress, or the save of a checkpoint."""
        since = time.monotonic() - (stopper.asked or time.monotonic())
        saving = sorted(self.checkpoints.glob(".tmp-step-*"), key=lambda p: p.stat().st_mtime if p.exists() else 0)
        done = self.progress()
        what = (f"the checkpoint of step {int(saving[-1].name.rsplit('-', 1)[1])} to be saved" if saving and
                saving[-1].stat().st_mtime > time.time() - since else
                f"the ranks to finish step {done[0] + 1} (step {done[0]} done {format_duration(time.time() - done[1])} "
                "ago) and save" if done else "the ranks to reach a step and save")
        return (f"{format_duration(since)} since the stop was asked, waiting for {what}; a forced stop (unsaved) in "
                f"{format_duration(max(0.0, stopper.grace_s - since))}")

    def waiting_for(self, last: str, stepping: bool) -> str:
        """`last`: the last line shown; `stepping`: whether a step line was shown yet."""
        expected = f"; ~{format_duration(self.step_s, fine=True)} a step expected here" if self.step_s else ""
        if stepping:
            done = self.progress()
            since = f", step {done[0]} done {format_duration(time.time() - done[1])} ago" if done else ""
            return f"training{since} (steps are printed every logging.interval{expected})"
        if self.own:
            return f"{self.own}, which has printed nothing {'more ' if last else ''}(slipway cannot tell its phases)"
        if not last:
            return (f"torchrun to start {self.procs} trainer processes (each imports torch, then they join one "
                    "process group)")
        if "tokeniz" in last:
            return "rank 0 tokenizing the data (the other ranks wait for it)"
        load = f"loading the checkpoint of step {self.resume_step}, then " if self.resume_step else ""
        first = ("compiling the model's blocks, then its first batch, forward and backward" if self.compiling
                 else "its first batch, forward and backward")
        return f"the model's build, {load}the first step: {first}{expected}"

    def progress(self) -> Optional[tuple[int, float]]:
        """(the last step this launch completed, when); None before one."""
        with contextlib.suppress(ValueError, KeyError, TypeError):  # damaged: none
            record = read_json(RunDir(self.run_dir).progress, 1 << 16) or {}  # a FIFO there: none, no wait
            if record.get("job") == self.tag and record["step"] > 0:
                return int(record["step"]), float(record["unix"])
        return None


class Output(threading.Thread):
    """Copies the launch's output to the log, and what `Noise` lets through to the terminal until a
    stop is asked; keeps the end report's facts (the trainer's one-line error or a crash's exception,
    the rank a signal killed). With a `heartbeat`, a silence of HEARTBEAT_SECONDS is told."""

    def __init__(self, stream, log, stopper: Stopper, heartbeat: Optional[Heartbeat] = None,
                 config_args: Optional[str] = None) -> None:
        super().__init__(name="slipway-local-output", daemon=True)
        self.stream, self.log, self.stopper, self.heartbeat = stream, log, stopper, heartbeat
        self.config_args = config_args  # what a `slipway ... CONFIG` the trainer suggests stands for here
        self.noise = Noise()
        self.everything = os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")
        self.trainer_error = ""
        self.failed_rank: Optional[str] = None
        self.rank_signal: Optional[int] = None
        self._terminal = True
        self._lock = threading.Lock()  # the log and the terminal, between this thread, the heartbeat's and notes
        self._last, self._last_at, self._stepping = "", time.monotonic(), False
        self._ended = threading.Event()
        self._cold_said = False

    @property
    def error(self) -> str:
        return self.trainer_error or self.noise.exception

    def note(self, text: str, terminal: bool = False) -> None:
        """A line of slipway's own into the log (and the terminal), above torch's lines that follow from it."""
        with self._lock:
            if terminal:
                self._write(f"{text}\n".encode())
            with contextlib.suppress(OSError, ValueError):
                self.log.write(f"slipway: {text}\n")
                self.log.flush()

    def _write(self, line: bytes) -> None:
        if not self._terminal:
            return
        try:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
        except (OSError, ValueError):  # the terminal is gone (SIGHUP): the log keeps it all
            self._terminal = False

    def _beat(self) -> None:
        assert self.heartbeat is not None
        while not self._ended.wait(1.0):
            with contextlib.suppress(OSError):  # a progress record or checkpoint that went meanwhile
                if self.stopper.signum is not None:
                    if time.monotonic() - max(self._last_at, self.stopper.asked or 0) >= STOP_TELL_SECONDS:
                        self.note(self.heartbeat.stopping(self.stopper), terminal=True)
                        self._last_at = time.monotonic()
                    continue
                if slow := self.heartbeat.pace():
                    self.note(slow, terminal=True)
            if time.monotonic() - self._last_at >= HEARTBEAT_SECONDS:
                since = format_duration(time.monotonic() - self.heartbeat.started)
                self.note(f"{since} since the launch, waiting for "
                          f"{self.heartbeat.waiting_for(self._last, self._stepping)}", terminal=True)
                self._last_at = time.monotonic()

    def run(self) -> None:
        if self.heartbeat is not None:
            threading.Thread(target=self._beat, name="slipway-heartbeat", daemon=True).start()
        try:
            self._copy()
        finally:
            self._ended.set()

    def _warm(self, node: str, what: str, why: Optional[str]) -> None:
        """A rank's start (trainer/warm.py) in events.log; the first cold one on the terminal too."""
        told = one_line(f"{what} on {node} started {'cold: ' + why if why is not None else 'warm'}")
        with contextlib.suppress(OSError):
            append_event(self.stopper.run_dir, LOCAL_JOB, f"warm: {told}")
        if why is not None and not self._cold_said:
            self._cold_said = True
            self.note(f"warm: {told} (each rank's start: events.log)", terminal=True)

    def _copy(self) -> None:
        rank, root = None, False
        for line in iter(self.stream.readline, b""):
            text = line.decode(errors="replace")
            warm = _WARM.match(text.rstrip("\n"))
            if warm:
                self._warm(*warm.groups())
            shown = self.noise.shown(text) and not warm
            with self._lock:
                if self.everything or (shown and self.stopper.signum is None):
                    # the trainer's suggestions, as this shell runs them with this run's config
                    self._write(as_typed(text, self.config_args).encode() if "`slipway " in text else line)
                    self._last, self._last_at = text, time.monotonic()
                    self._stepping = self._stepping or text.startswith("step ")
                self.log.write(text)
                self.log.flush()
            if text.startswith("error: "):  # the trainer's one-line reason
                self.trainer_error = text.removeprefix("error: ").strip()
            # torchrun's report of failed workers: only its "Root Cause (first observed failure)"
            # entry counts (the others are the ranks torchrun itself then sent SIGTERM): `rank : 1
            # (local_rank: 1)`, then `exitcode : -9 (pid: 123)` for one a signal killed
            if "Root Cause" in text:
                root, rank = True, None
            if m := re.match(r"\s*rank\s*:\s*(\d+)", text):
                rank = m.group(1)
            if (m := re.match(r"\s*exitcode\s*:\s*-(\d+)", text)) and root and self.rank_signal is None:
                self.failed_rank, self.rank_signal = rank, int(m.group(1))


def oom_kills() -> Optional[int]:
    """/proc/vmstat's oom_kill: the processes the OOM killer ended since boot (any cgroup's); None unread."""
    with contextlib.suppress(OSError, ValueError), open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return None
