"""The machinery of `slipway gpu-check`: parts, each a few processes under a time budget of its own,
and the report they fill, rewritten after every part.

A part's steps run in order, each as a process group of its own; one still running at the part's
deadline is stopped (its whole group) and the part's remaining steps are skipped, each named in the
report with the reason: a slow part never takes another's time, nor the check more than its budgets.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Union

from common.errors import ConfigError, failure_line
from common.fs import write_atomic
from common.secrets import mask
from jobs.gpucheck.report import render_markdown

# Seconds per part: 580 in all, and at most STOP_GRACE_SECONDS twice more for a stopped step, so the
# whole check stays within ten minutes. The speed part has the most: compiling is its slowest step.
BUDGETS = {"node": 45.0, "correctness": 75.0, "training": 150.0, "allreduce": 30.0, "speed": 280.0}
MIN_STEP_SECONDS = 3.0  # a step with less of its part's budget left is skipped, not started
STOP_GRACE_SECONDS = 10.0  # a stopped step's processes get this long before SIGKILL
WORK_MARK = ".slipway-gpu-check"  # marks OUT/work as this command's own, to be replaced by the next check

# A part's plan: (what, the step, or why it does not run on this node).
Plan = list[tuple[str, Union[Callable[["Part"], None], str]]]


class OutOfTime(Exception):
    """A step did not start (too little budget left) or ran past its part's budget."""


@dataclass
class Part:
    name: str
    budget_s: float
    status: str = "not run"  # ok | failed | incomplete | skipped
    seconds: float = 0.0
    results: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)  # {"what", "ok", "detail"}
    skipped: list = field(default_factory=list)  # {"what", "why"}
    deadline: float = field(default=0.0, repr=False)

    def check(self, what: str, ok: bool, detail: str) -> bool:
        self.checks.append({"what": what, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def skip(self, what: str, why: str) -> None:
        self.skipped.append({"what": what, "why": why})


class Check:
    """One `slipway gpu-check`: its parts, the processes they start, the report."""

    def __init__(self, out: Path, budgets: dict[str, float], console) -> None:
        self.out, self.budgets, self.console = out, budgets, console
        self.work = out / "work"
        self.parts: list[Part] = []
        self.device: Optional[str] = None  # until `start`
        self.devices = 2
        self.started = datetime.now(timezone.utc)
        self._clock = time.monotonic()

    def part(self, name: str) -> Part:
        part = Part(name, self.budgets[name])
        part.deadline = time.monotonic() + part.budget_s
        self.parts.append(part)
        return part

    def start(self, device: str, gpus: int) -> None:
        """From here on the check writes: its device, and a fresh work directory."""
        self.device = device
        self.devices = min(gpus, 8) if device == "cuda" else 2  # on the CPU two processes stand for two GPUs
        if self.work.exists():
            shutil.rmtree(self.work)
        (self.work / "logs").mkdir(parents=True)
        (self.work / WORK_MARK).write_text(f"{os.getpid()}\n")

    @contextlib.contextmanager
    def claimed(self):
        """OUT locked for this check; a work directory no earlier check made is refused, OUT left as found."""
        created = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        lock_path = self.out / ".gpu-check.lock"
        try:
            with open(lock_path, "a+") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    raise ConfigError("--out", f"another slipway gpu-check writes to {self.out}: wait for it, or "
                                               "give another directory") from None
                if self.work.is_symlink() or (self.work.exists() and not (self.work / WORK_MARK).is_file()):
                    raise ConfigError("--out", f"{self.work} exists and is not a gpu-check's work directory: move it "
                                               "away, or give another directory")
                yield
        except ConfigError:
            if created and not self.work.exists():
                with contextlib.suppress(OSError):
                    lock_path.unlink()
                    self.out.rmdir()
            raise

    def run(self, part: Part, what: str, argv: list[str], env: Optional[dict] = None, cwd: Optional[Path] = None,
            interrupt: bool = False, write_log: bool = True) -> tuple[int, str]:
        """`argv` as a process group of its own, stopped at the part's deadline (`stop_group`, OutOfTime)."""
        left = part.deadline - time.monotonic()
        if left < MIN_STEP_SECONDS:
            raise OutOfTime(f"not started: {max(left, 0):.0f} s of the part's {part.budget_s:g} s budget was left, "
                            f"less than a step's {MIN_STEP_SECONDS:g} s")
        if self.console is not None:
            self.console.print(f"[dim]gpu-check {time.monotonic() - self._clock:5.0f} s  {part.name}: {what}[/]",
                               highlight=False)
        hide = {"CUDA_VISIBLE_DEVICES": ""} if self.device == "cpu" else {}  # --device cpu on a GPU node too
        proc = subprocess.Popen(argv, cwd=cwd or self.work, env={**os.environ, **(env or {}), **hide}, text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=left)
            ran_out = False
        except subprocess.TimeoutExpired:
            stop_group(proc, interrupt)
            try:
                output, _ = proc.communicate(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:  # a process that left the group holds the pipe: leave it
                output = ""
            ran_out = True
        if write_log:
            write_atomic(self.work / "logs" / f"{part.name}-{re.sub(r'[^A-Za-z0-9.]+', '-', what)}.log", output or "")
        if ran_out:
            raise OutOfTime(f"stopped: it ran past the part's {part.budget_s:g} s budget")
        return proc.returncode, output or ""

    def run_json(self, part: Part, what: str, argv: list[str], **kw) -> Optional[dict]:
        """The `RESULT {json}` line of a process; None (the reason in the part) when it gave none."""
        rc, output = self.run(part, what, argv, **kw)
        for line in output.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        part.check(what, False, f"exit {rc}: {failure_line(output)}")
        return None

    def run_part(self, name: str, plan: Plan) -> Part:
        part, t0 = self.part(name), time.monotonic()
        for i, (what, step) in enumerate(plan):
            if isinstance(step, str):  # not for this node: the reason
                part.skip(what, step)
                continue
            try:
                step(part)
            except OutOfTime as exc:
                part.skip(what, str(exc))
                for later, _ in plan[i + 1:]:
                    part.skip(later, f"not started: the part's budget ran out at {what!r}")
                break
            except Exception as exc:  # what a node answered that the check did not foresee: one failed check
                part.check(what, False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        self.finish(part, t0)
        return part

    def finish(self, part: Part, t0: float) -> None:
        part.seconds = time.monotonic() - t0
        ran = bool(part.checks or part.results)
        part.status = ("failed" if any(not c["ok"] for c in part.checks) else
                       "incomplete" if ran and any("budget" in s["why"] for s in part.skipped) else
                       "ok" if ran else "skipped")
        failed = any(not c["ok"] for p in self.parts for c in p.checks)
        report = {"format": 1, "command": "slipway gpu-check", "device": self.device, "devices": self.devices,
                  "started": self.started.isoformat(timespec="seconds"),
                  "seconds": round(time.monotonic() - self._clock, 1),
                  "verdict": "failed" if failed else "passed" if all(p.status == "ok" for p in self.parts)
                  else "passed what ran",
                  "budgets": self.budgets,
                  "parts": [{k: v for k, v in asdict(p).items() if k != "deadline"} for p in self.parts]}
        # What the node said (its environment, paths, errors) is masked by the one secret policy.
        write_atomic(self.out / "report.json", mask(json.dumps(report, indent=1)) + "\n")
        write_atomic(self.out / "report.md", mask(render_markdown(report)))


def stop_group(proc: subprocess.Popen, interrupt: bool) -> None:
    """End a step's process group: two SIGINTs (slipway local: stop now, unsaved) or SIGTERM, then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        if interrupt:
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
