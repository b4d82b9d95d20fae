"""The run directory: every path a run holds, defined once in `RunDir` (the host, the batch script's
renderer, the local launcher and the trainer take them from it; the batch script gets them from
`RunDir.shell_paths`, never composing one), and what the sides agree on beyond paths: exit codes,
the code snapshot's record, a whole checkpoint, `SaveLine` and `HangLine`. events.log's lines are
common/events.py's. Stdlib only: the trainer imports it, and so does the host.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common.fs import open_regular
from common.tagged import TaggedLine, key
# Exit codes of a launch, one per end: the trainer's and the batch script's (jobs/slurm/job_lib.sh),
# and the same code in events.log (`end exit N`), `slipway status`, `watch` and `logs -f`. Where the
# batch script recorded its end, that code is the launch's, whatever Slurm says of a cleanup it
# killed after it (jobs/runs/lifecycle.py). docs/runs.md's table says each; tests/test_docs.py checks it.
FAILED_EXIT = 1  # a crash (its traceback in the log), or a checkpoint that does not fit (one `error:` line)
BAD_INPUT_EXIT = 2  # bad config or input: one `error:` line
NONFINITE_EXIT = 3  # stopped on non-finite numbers (train.max_nonfinite_steps)
HANG_EXIT = 4  # hung, not retried
PREFLIGHT_EXIT = 5  # a node failed the preflight (trainer/preflight.py) and the job was not retried elsewhere
REQUEUE_EXIT = 75  # saved and stopped after the time-limit warning, no requeue left
INTERRUPTED_EXIT = 130  # a local launch stopped by Ctrl-C (128 + SIGINT)
CANCEL_EXIT = 140  # `slipway cancel`: USR2 to the batch shell (128 + SIGUSR2)
TERM_EXIT = 143  # SIGTERM to a job: a plain scancel, a preemption, the time limit (128 + SIGTERM)
# Any other code above 128 is 128 + the signal that ended the launch (a rank, or a local launch's launcher).
# slipway's own commands end 0, FAILED_EXIT (a Slurm command failed), BAD_INPUT_EXIT or, for an
# internal error (a bug, said as such; common/edge.py), BUG_EXIT (EX_SOFTWARE).
BUG_EXIT = 70

LOCAL_JOB = "local"  # the job field of a launch on this machine
# The preflight's all-reduce (trainer/preflight.py AllReduceGate), asked for by PREFLIGHT_ENV="MEGABYTES
# TIMEOUT_S"; a rank that fails it writes why to PREFLIGHT_FAILED_FILE in $SLIPWAY_EXITS (job_lib.sh
# `after_preflight` reads it).
PREFLIGHT_ENV = "SLIPWAY_PREFLIGHT_ALLREDUCE"
PREFLIGHT_FAILED_FILE = "preflight-failed"
# The code snapshot the ranks run (jobs/runs/code.py): its directory, set in their environment.
CODE_ENV = "SLIPWAY_CODE"


@dataclass(frozen=True)
class RunDir:
    """`runs/RUN/`'s files; `project`: the checkout launched from, where the batch script works (None: the trainer)."""

    path: Path
    project: Optional[Path] = None

    # What the submission writes (jobs/runs/submit.py), read by the job and the host.
    config = property(lambda self: self.path / "config.yaml")  # the resolved config, as the job reads it
    env_toml = property(lambda self: self.path / "env.toml")  # the Container Engine's environment (edf)
    job_script = property(lambda self: self.path / "job.sbatch")
    prepare_script = property(lambda self: self.path / "prepare.sbatch")  # the data preparation job
    manifest = property(lambda self: self.path / "manifest.json")  # jobs/runs/manifest.py
    lib = property(lambda self: self.path / "lib")  # the job library, pinned by hash (lib/NAME-HASH12.sh)
    history = property(lambda self: self.path / "history")  # configs and code records a change replaced
    listing = property(lambda self: self.path / ".listing.json")  # what a listing shows (jobs/runs/listing.py)
    # What the launches write.
    events = property(lambda self: self.path / "events.log")  # common/events.py
    logs = property(lambda self: self.path / "logs")  # Slurm's and the local launches' logs
    heartbeat = property(lambda self: self.path / "heartbeat")  # the batch shell's, every HEARTBEAT_SECONDS
    heartbeats = property(lambda self: self.path / "heartbeats")  # heartbeats/NODE: each node's
    gutil = property(lambda self: self.path / "gutil")  # gutil/NODE.gutil: nvidia-smi dmon samples
    hangs = property(lambda self: self.path / "hangs")  # hangs/TAG-HOST-RANK.txt: the watchdog's dumps
    exits = property(lambda self: self.path / ".exits")  # .exits/TAG/: the training step's exit reports
    # The trainer's (trainer/metrics.py, trainer/watchdog.py, trainer/loop.py).
    metrics = property(lambda self: self.path / "metrics.jsonl")  # common/metrics_log.py
    progress = property(lambda self: self.path / "progress.json")  # rank 0's last step, for `slipway watch`
    # Made at the time-limit warning or a stop request: the trainer saves and exits REQUEUE_EXIT.
    stop_file = property(lambda self: self.path / "stop-requested")
    # One SaveLine per completed checkpoint save (rank 0): what the batch script's warning lead reads.
    saves = property(lambda self: self.path / "saves.log")
    curves = property(lambda self: self.path / "curves.png")  # `slipway plot`
    # Beside the runs, not of one: the warm processes' logs (`slipway run`), ALLOCATION-KEY.out.
    warm_logs = property(lambda self: self.path.parent / ".warm")

    def hang_dump(self, tag: str, host: str, rank: int) -> Path:
        return self.hangs / f"{tag}-{host}-{rank}.txt"

    def hang_dumps(self, tag: str) -> list[Path]:
        """The dumps the ranks of attempt `tag` wrote, in name order."""
        return sorted(self.hangs.glob(f"{glob.escape(tag)}-*.txt"))

    def node_heartbeat(self, node: str) -> Path:
        return self.heartbeats / node

    def node_gutil(self, node: str) -> Path:
        return self.gutil / f"{node}.gutil"

    def shell_paths(self, checkpoint_dir: str) -> dict[str, Path]:
        """The batch script's names for these paths: the job library uses only these. `checkpoint_dir`:
        checkpoint.dir, relative to the run directory or absolute."""
        return {"RUN_DIR": self.path, "EVENTS_LOG": self.events, "LOGS": self.logs, "HEARTBEAT": self.heartbeat,
                "HEARTBEATS": self.heartbeats, "GUTIL": self.gutil, "HANGS": self.hangs, "EXITS": self.exits,
                "STOP_FILE": self.stop_file, "SAVES": self.saves, "CHECKPOINT_DIR": self.path / checkpoint_dir}


@dataclass(frozen=True)
class CodeSnapshot:
    """A run's code snapshot (jobs/runs/code.py), as the manifest records it; the job script and env.toml name `dir`."""

    hash: str
    dir: str  # absolute: RUNS/.code/HASH16
    files: int = 0
    bytes: int = 0
    source: str = ""  # the trainer package it was taken from
    commit: Optional[str] = None  # the checkout's HEAD, when it is one
    dirty: Optional[bool] = None  # snapshotted files differ from that commit
    script: Optional[str] = None  # the train.script inside the snapshot (absolute)

    @property
    def hash12(self) -> str:
        return self.hash[:12]

    def record(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def environment(self, pythonpath: Optional[str] = None) -> dict[str, str]:
        """What puts the snapshot in front of any installed `trainer` (`pythonpath`: one to keep behind it)."""
        # PYTHONSAFEPATH keeps the working directory out of sys.path, and with it a script's own
        # folder: the snapshot's copy of that folder follows the snapshot on the path instead.
        path = [self.dir, *([str(Path(self.script).parent)] if self.script else []), *([pythonpath] if pythonpath else [])]
        return {CODE_ENV: self.dir, "PYTHONPATH": ":".join(path), "PYTHONSAFEPATH": "1"}


def check_code(package_file: str, environ: Optional[dict] = None) -> Optional[str]:
    """Where the running `trainer` package comes from, against the snapshot the launch named
    ($SLIPWAY_CODE): None when it is the snapshot's (or none was named), else why not, in one line."""
    code = (os.environ if environ is None else environ).get(CODE_ENV)
    here = Path(package_file).resolve().parent
    if not code or Path(code).resolve() / "trainer" == here:
        return None
    return (f"this process runs the trainer from {here}, not the run's code snapshot {code}/trainer "
            f"({CODE_ENV}): something ahead of PYTHONPATH shadows it (a `trainer` in the working directory "
            "with a Python older than 3.11, which ignores PYTHONSAFEPATH, or a .pth file); run from another "
            "directory or set code.snapshot: false")


CHECKPOINT_MARKER = "COMPLETE"
_CHECKPOINT_STEP = re.compile(r"step-(\d+)")


def checkpoint_complete(path: Path) -> bool:
    """The one rule for a whole checkpoint, for the trainer's loads and the host's resume checks:
    its marker (written last) and torch.distributed.checkpoint's .metadata are there."""
    return (path / CHECKPOINT_MARKER).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(ckpt_dir: str | os.PathLike) -> list[int]:
    """The steps of `ckpt_dir`'s complete checkpoints, ascending (job_lib.sh's latest_checkpoint agrees)."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        return []
    return sorted(int(m.group(1)) for p in path.iterdir()
                  if (m := _CHECKPOINT_STEP.fullmatch(p.name)) and p.is_dir() and checkpoint_complete(p))


@dataclass(frozen=True)
class SaveLine(TaggedLine):
    """One completed checkpoint save, a line of saves.log (trainer/checkpoint.py writes it, job_lib.sh
    `warning_lead` reads it), in whole milliseconds as bash reckons: `ms` from the save's start to its
    commit (an asynchronous save's writing included), `step_ms` the mean step before it (0: none yet)."""

    step: int
    ms: int
    bytes: int
    step_ms: int
    at: str

    TAG = "slipway-save"


@dataclass(frozen=True)
class HangLine(TaggedLine):
    """The first line of a hang dump (trainer/watchdog.py writes it; the batch script, `slipway status` and
    the local launcher read it). `answered=late`: the rank was frozen or starved until the teardown woke it."""

    rank: int
    host: str
    step: int
    idle_s: float = key("idle", "{:.1f}")
    limit_s: float = key("limit", "{:g}")
    on_time: bool = key("answered", words=("late", "on-time"))

    TAG = "slipway-hang"

    @classmethod
    def read(cls, path: Path) -> Optional["HangLine"]:
        """The first line of the dump at `path` (None: unreadable, or no hang line)."""
        try:
            f = open_regular(path)
            if f is None:
                return None
            with f:
                return cls.parse(f.readline(4096).decode(errors="replace"))
        except OSError:
            return None
