"""The hang watchdog: a run that stops making progress ends, with every rank's stacks on disk
(what it writes and when: docs/runs.md, "Hang watchdog").

Each rank runs one `HangWatchdog`, a thread the training loop tells of every step it queues
(`step_queued`: one append); on CUDA a step is done when its completion marker says the device got
there (asked without blocking), and a sync step, where the host has waited, says so (`step_done`).
When no step completes in time, the thread writes the rank's dump, waits until `dump_window_s`
after it noticed (the other ranks, whose watchdogs fire within milliseconds at the same all-reduce,
finish their dumps before the launcher tears the job down on this rank's exit), and exits with
HANG_EXIT by `os._exit` (the main thread is stuck), a timer started first making the exit sure even
if writing the dump blocks. torchrun turns a worker's exit code into 1, so the batch script decides
"hung" from the dump files, not from the exit status. Checkpoint work is no step (`paused`): past
`train.checkpoint_timeout` every rank exits SLOW_CHECKPOINT_EXIT. Rank 0's watchdog also keeps
`RUN/progress.json` (the last completed step and its wall-clock time) for `slipway watch`.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import faulthandler
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Protocol

from common import environ
from common.events import append_event
from common.rundir import HANG_EXIT, LOCAL_JOB, HangLine, RunDir
from trainer.config import TrainSection
from common.fs import write_atomic

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 1.0  # rank 0 rewrites progress.json at most this often (from its own thread)
DUMP_WINDOW_SECONDS = 10.0  # a rank exits this long after noticing the hang (see the module docstring)
HARD_EXIT_SECONDS = 30.0  # ... and at the latest this long after, whatever blocks the dump
PYSPY_SECONDS = 8.0  # py-spy dump's own time limit
# A watchdog that notices more than this past its deadline was not running when the deadline
# came (the process frozen, or starved): its dump says `late`, and the batch script counts its
# rank among those that did not answer. Less than DUMP_WINDOW_SECONDS, within which the others
# exit, after which Slurm's teardown (SIGCONT, then SIGTERM) lets a frozen rank dump at last.
LATE_SECONDS = 5.0
# A collective may wait this long past the watchdog's longest limit before torch aborts it:
# the watchdog fires first, dumps (DUMP_WINDOW_SECONDS) and exits (HARD_EXIT_SECONDS at the
# latest), so a hang ends as HANG_EXIT with every rank's stacks, not as a collective timeout
# error (a crash to the batch script) with none.
COLLECTIVE_MARGIN_SECONDS = 120.0
# The thread asks queued steps' completion markers this often (and a marker's step counts as
# done when it notices, so a hang's step and idle time are this exact).
MARKER_POLL_SECONDS = 0.5
SLOW_CHECKPOINT_EXIT = 1
# With the watchdog off (hang_timeout 0) the collective timeout is the only hang detector: long
# enough for a first step that compiles (NCCL's own default, 10 min, is not).
WATCHDOG_OFF_COLLECTIVE_SECONDS = 3600.0


def collective_timeout(cfg: TrainSection) -> timedelta:
    """The timeout of every process group the trainer makes (default, mesh, stop vote, checkpointer):
    longer than the watchdog's limits, the first step's and a checkpoint's included. The preflight's
    all-reduce keeps its own bound (slurm.preflight_timeout): no watchdog runs there."""
    if cfg.hang_timeout <= 0:
        return timedelta(seconds=WATCHDOG_OFF_COLLECTIVE_SECONDS)
    longest = max(cfg.hang_timeout, cfg.hang_timeout_first_step, cfg.checkpoint_timeout)
    return timedelta(seconds=longest + COLLECTIVE_MARGIN_SECONDS)


def process_group_timeouts() -> list[str]:
    """`name backend seconds` of each process group of this process, for the hang dumps: a
    group whose timeout is shorter than the watchdog's limit would crash the run first."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    rows = []
    for pg, name in list(dist.distributed_c10d._world.pg_names.items()):
        for device in ("cpu", "cuda"):
            try:
                backend = pg._get_backend(torch.device(device))
                seconds = backend.options._timeout.total_seconds()
            except Exception:  # not on this device, or a backend without options: nothing to show
                continue
            rows.append(f"{name} {type(backend).__name__} {seconds:g}")
            break  # one backend a group: gloo answers for both devices
    return rows


def node_name() -> str:
    """The Slurm node this rank runs on (the name `scontrol show hostnames` gives), else the hostname
    where it is a name (it goes into file names and events: `unnamed` where it is not)."""
    host = socket.gethostname()
    return environ.word("SLURMD_NODENAME") or (host if environ.WORD.fullmatch(host) else "unnamed")


def job_tag() -> str:
    """Names this job attempt in file names: the batch script's SLIPWAY_JOB_TAG (the job id, with
    rN for its Nth requeue), else the Slurm job id, else `local`."""
    return environ.word("SLIPWAY_JOB_TAG") or environ.job_id() or "local"


def event_job(env: Mapping[str, str] = os.environ) -> str:
    """The job field of this process's events.log lines, as the batch script's `event()` writes it."""
    return env.get("SLIPWAY_EVENT_JOB") or env.get("SLURM_JOB_ID") or LOCAL_JOB


def dump_path(run_dir: Path, rank: int) -> Path:
    return RunDir(Path(run_dir)).hang_dump(job_tag(), node_name(), rank)


class Marker(Protocol):
    """Says, without blocking, whether the device has reached it (torch.cuda.Event)."""

    def query(self) -> bool: ...


class HangWatchdog:
    """One per rank: `start(step)` before the loop, `step_queued(step, marker)` after each step
    (`step_done(step)` where the host has waited for it), `paused(what)` around checkpoint work,
    `stop()` after."""

    def __init__(self, cfg: TrainSection, run_dir: Path, rank: int, *,
                 dump_window_s: float = DUMP_WINDOW_SECONDS, hard_exit_s: float = HARD_EXIT_SECONDS,
                 exit: Callable[[int], None] = os._exit):
        self.timeout_s = float(cfg.hang_timeout)
        self.first_timeout_s = float(cfg.hang_timeout_first_step)
        self.checkpoint_timeout_s = float(cfg.checkpoint_timeout)
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.dump_window_s = dump_window_s
        self.hard_exit_s = hard_exit_s
        self._exit = exit
        # (monotonic time, step) of the last completed step, one tuple so the thread never
        # reads the time of one step with the number of another. Both threads write it, under
        # the lock, and only ever forward.
        self._mark: tuple[float, int] = (time.monotonic(), 0)
        self._lock = threading.Lock()
        self._queued: collections.deque[tuple[int, Marker]] = collections.deque()
        # (monotonic time, what) of the checkpoint work in progress, and how deep `paused` is.
        self._pause: Optional[tuple[float, str]] = None
        self._depth = 0
        self._start_step = 0
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._device: Optional[int] = None  # the rank's CUDA device, which the thread asks the markers on

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def start(self, step: int) -> "HangWatchdog":
        """Watch from now: training (re)starts after `step` (again after a checkpoint's load)."""
        with self._lock:
            self._start_step = step
            self._mark = (time.monotonic(), step)
        self._queued.clear()
        if self.enabled and self._thread is None:
            # The rank's CUDA device (the trainer set it first; each thread has its own current device).
            torch = sys.modules.get("torch")
            self._device = torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else None
            self._thread = threading.Thread(target=self._run, name="slipway-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def step_queued(self, step: int, marker: Optional[Marker]) -> None:
        """Step `step` is queued; it is done once `marker` says so (None: done now). The hot path."""
        if marker is None or not self.enabled:  # off: no thread would ever empty the queue
            self.step_done(step)
        else:
            self._queued.append((step, marker))

    def step_done(self, step: int) -> None:
        """Step `step` has completed on this rank's device."""
        self._advance(time.monotonic(), step)

    @contextlib.contextmanager
    def paused(self, what: str) -> Iterator[None]:
        """Checkpoint work (`what`: "the checkpoint save of step 100") runs: no step limit, the
        checkpoint's own bound instead; the step limit starts anew after it."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._pause = (time.monotonic(), what)
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._pause = None
                    self._mark = (time.monotonic(), self._mark[1])

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.rank == 0 and self.enabled:
            self._write_progress(*self._mark)

    # ------------------------------------------------------------ the thread

    def _advance(self, at: float, step: int) -> None:
        with self._lock:
            if step > self._mark[1]:
                self._mark = (at, step)

    def _drain(self) -> None:
        """The queued steps the device has reached, oldest first, as done (noticed now)."""
        while self._queued:
            step, marker = self._queued[0]
            try:
                reached = marker.query()
            except Exception:  # a broken device: the main thread gets the error; no step is done
                return
            if not reached:
                return
            self._queued.popleft()
            self._advance(time.monotonic(), step)

    def _limit(self, step: int) -> float:
        return self.first_timeout_s if step == self._start_step else self.timeout_s

    def _run(self) -> None:
        if self._device is not None:  # a new thread's CUDA device is 0: querying there would open a context on GPU 0
            sys.modules["torch"].cuda.set_device(self._device)
        written, written_at = None, 0.0
        while not self._stopped.is_set():
            self._drain()
            now = time.monotonic()
            with self._lock:
                (at, step), pause = self._mark, self._pause
            if pause is not None:
                since, what = pause
                if self.checkpoint_timeout_s > 0 and now - since >= self.checkpoint_timeout_s:
                    self._fire_slow_checkpoint(what, now - since)
                    return
                wait = self.checkpoint_timeout_s - (now - since) if self.checkpoint_timeout_s > 0 else self.timeout_s
            else:
                deadline = at + self._limit(step)
                if now >= deadline:
                    self._fire(now - at, step, self._limit(step))
                    return
                # During the first step the deadline is the long one; once it completes the deadline
                # moves earlier, which step_done does not announce: look again every hang_timeout.
                wait = min(deadline - now, self.timeout_s)
            if self._queued:
                wait = min(wait, MARKER_POLL_SECONDS)
            if self.rank == 0:
                if step != written and now - written_at >= PROGRESS_SECONDS:
                    self._write_progress(at, step)
                    written, written_at = step, now
                wait = min(wait, PROGRESS_SECONDS)
            self._stopped.wait(max(wait, 0.01))

    def _write_progress(self, at: float, step: int) -> None:
        wall = time.time() - (time.monotonic() - at)
        record = {"step": step, "time": datetime.fromtimestamp(wall, timezone.utc).isoformat(timespec="seconds"),
                  "unix": round(wall, 3), "job": job_tag(), "hang_timeout": self.timeout_s}
        try:  # renamed into place, not fsynced: a reader sees this record or the last, and a lost one is no loss
            write_atomic(RunDir(self.run_dir).progress, json.dumps(record) + "\n", sync=False)
        except OSError as exc:  # the view loses a figure; training must not
            log.debug("progress.json not written: %s", exc)

    def _exit_timer(self, code: int) -> threading.Timer:
        """Whatever happens after it (a dump blocked on a hung filesystem), the process ends."""
        killer = threading.Timer(self.hard_exit_s, self._exit, (code,))
        killer.daemon = True
        killer.start()
        return killer

    def _fire(self, idle_s: float, step: int, limit_s: float) -> None:
        noticed, killer = time.monotonic(), self._exit_timer(HANG_EXIT)
        path = dump_path(self.run_dir, self.rank)
        what = (f"no training step completed for {idle_s:.1f} s after step {step} (limit {limit_s:g} s: "
                f"train.{'hang_timeout_first_step' if step == self._start_step else 'hang_timeout'})")
        try:
            self._write_dump(path, what, step, idle_s, limit_s)
            log.error("rank %d on %s: %s; stacks of every thread in %s; exiting %d", self.rank, node_name(), what,
                      path, HANG_EXIT)
        except OSError as exc:
            log.error("rank %d on %s: %s; the stack dump could not be written (%s): stacks follow on stderr",
                      self.rank, node_name(), what, exc)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self._end(noticed, killer, HANG_EXIT)

    def _fire_slow_checkpoint(self, what: str, seconds: float) -> None:
        """Checkpoint work outlasted train.checkpoint_timeout: no hang, a failure, the stacks in the log."""
        noticed, killer = time.monotonic(), self._exit_timer(SLOW_CHECKPOINT_EXIT)
        text = (f"slow checkpoint: {what} has taken {seconds:.0f} s, over train.checkpoint_timeout "
                f"({self.checkpoint_timeout_s:g} s), on rank {self.rank} ({node_name()}): the file system where "
                "checkpoints go is slow or stuck, not a node; the run ends (exit "
                f"{SLOW_CHECKPOINT_EXIT}) and resumes from the latest complete checkpoint: raise "
                "train.checkpoint_timeout for a file system this slow, or set checkpoint.dir elsewhere")
        log.error("%s; stacks of every thread follow", text)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.rank == 0:
            try:  # one line for the run, from rank 0 (every rank notices within moments of the others)
                append_event(self.run_dir, event_job(), text)
            except OSError as exc:
                log.error("events.log not written: %s", exc)
        self._end(noticed, killer, SLOW_CHECKPOINT_EXIT)

    def _end(self, noticed: float, killer: threading.Timer, code: int) -> None:
        """Flush what this rank said, wait out the dump window (the module's doc), exit `code`."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        time.sleep(max(0.0, self.dump_window_s - (time.monotonic() - noticed)))
        killer.cancel()
        self._exit(code)

    def _write_dump(self, path: Path, what: str, step: int, idle_s: float, limit_s: float) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        host = node_name()
        with open(path, "w") as f:
            # The first line is what the batch script, `slipway status` and the local launcher read.
            f.write(HangLine(self.rank, host, step, idle_s, limit_s, on_time=idle_s - limit_s <= LATE_SECONDS).line()
                    + "\n")
            f.write(f"{what}\nrank {self.rank} of {os.environ.get('WORLD_SIZE', '1')}, host {host}, pid "
                    f"{os.getpid()}, job {job_tag()}, at {datetime.now(timezone.utc).isoformat(timespec='seconds')}"
                    "\n\n")
            f.write(flight_recorder(path.with_suffix(".fr.pkl")) + "\n\n")
            if groups := process_group_timeouts():
                f.write("process group timeouts (name backend seconds): " + "; ".join(groups) + "\n\n")
            f.write("Python stacks of every thread (faulthandler), most recent call first:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.flush()
            if spy := py_spy_dump(os.getpid()):
                f.write("\n" + spy + "\n")


def flight_recorder(out: Path) -> str:
    """Write torch's flight recorder trace (the last collectives of every process group, with their
    state; TORCH_FR_BUFFER_SIZE > 0) to `out`; a summary line of the latest one."""
    try:
        import pickle

        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return "flight recorder: not available (no torch.distributed)"
    if not dist.is_available() or not dist.is_initialized():
        return "flight recorder: no process group"
    try:
        raw = c10d._dump_fr_trace()
        trace = pickle.loads(raw)
    except Exception as exc:  # a diagnostic must not stop the dump of the stacks
        return f"flight recorder: could not be read ({type(exc).__name__}: {exc})"
    entries = trace.get("entries") or []
    if not entries:
        return ("flight recorder: empty (set TORCH_FR_BUFFER_SIZE, as slipway's batch script does, to record "
                "the last collectives)")
    write_atomic(out, raw)
    last = entries[-1]
    group = last.get("process_group") or ("?", "?")
    return (f"flight recorder: {len(entries)} collectives recorded; the latest is #{last.get('collective_seq_id')} "
            f"{last.get('profiling_name')} on process group {group[-1]} ({last.get('state')}, sizes "
            f"{last.get('input_sizes')}); the whole trace in {out.name}")


def py_spy() -> Optional[str]:
    beside = Path(sys.executable).parent / "py-spy"  # a venv's own, not on PATH in a job
    return shutil.which("py-spy") or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)


def py_spy_dump(pid: int) -> str:
    """`py-spy dump` of process `pid` (this one): native frames and the stuck thread's state,
    which faulthandler does not show. Empty when py-spy is not installed."""
    exe = py_spy()
    if exe is None:
        return ""
    # Yama's ptrace_scope 1 lets only ancestors trace a process: allow py-spy, our child
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, ANY
    try:
        proc = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=PYSPY_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy dump: did not finish ({exc})"
    if proc.returncode != 0:
        return f"py-spy dump: exit {proc.returncode}: {' '.join((proc.stderr or proc.stdout).split())[:500]}"
    return "py-spy dump:\n" + proc.stdout
