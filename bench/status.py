"""Status at scale: `slipway status`, `status RUN`, `watch RUN --once` and a submission (with the
code store's pruning) against N synthetic runs and a stand-in Slurm that counts its calls.

Each size gets its own runs directory: ended runs (completed, failed, hung, cancelled by
`slipway cancel`, by a plain scancel), running, queued, requeued and ones Slurm no longer knows,
mixed; one run in a hundred with a long metrics.jsonl (2 MiB) and a long events.log (a thousand
attempts); and, unless --clean, a damaged run (its manifest.json cut short) and a teammate's run
closed to the user (mode 0700, another uid's). As root, which every permission lets through, the
commands run without the capabilities that override permissions (setpriv), as any user's would.
The stand-in Slurm (tests/slurm_standin.py) knows the jobs as Slurm would: active ones
in slurmctld, ended ones in accounting. Every command runs through the CLI, as a user types it;
"Slurm calls" counts squeue, sacct and `scontrol show job`; "CPU s" is the command's user and
system time; "lines" what it printed (a listing: two heads and a line a run); "MiB" its peak memory; "load"
the load average as it ended. `--before REF` runs the same commands with slipway at git commit
REF too (sizes up to --before-max), side by side.

    python bench/status.py [--sizes 1,100,1000,10000] [--repeat 3] [--before REF] [--clean]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Not bench/ first on the path: bench/trainer.py would stand for the trainer package.
sys.path[:1] = [str(ROOT), str(ROOT / "tests")]

from slurm_standin import StandInSlurm  # noqa: E402

from jobs.config import dump_config, load_config  # noqa: E402
from jobs.runs import manifest as manifests  # noqa: E402
from jobs.runs.image import ImagePin  # noqa: E402
from jobs.runs.manifest import Launch, Manifest  # noqa: E402
from common.events import format_event  # noqa: E402
from common.rundir import CodeSnapshot

# Of every 20 runs: how many end each way (the kinds below), as a sweep's directory holds them.
MIX = [("completed", 8), ("failed", 2), ("hung", 1), ("cancelled", 1), ("scancelled", 1), ("running", 3),
       ("queued", 2), ("requeued", 1), ("unknown", 1)]
START = "start on node[1-2] (restart {n}), failure retries 0/2, time-limit requeues {n}/20"
STEPS = 200


def kinds(n: int) -> list[str]:
    cycle = [k for k, count in MIX for _ in range(count)]
    return [cycle[i % len(cycle)] for i in range(n)]


def stamp(i: int, second: int = 0) -> str:
    return f"2026-01-{1 + i % 28:02d}T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{second:02d}+00:00"


def events_of(kind: str, job: str, i: int, attempts: int) -> list[str]:
    lines = []
    for a in range(attempts if kind not in ("queued",) else 0):
        lines += [START.format(n=a), "preflight ok on node[1-2]: all-reduce 1 GB in 0.4 s"]
        if a < attempts - 1:
            lines += ["time limit warning: stop requested", f"time-limit requeue {a + 1}/20: saved, requeueing",
                      "end exit 0"]
    lines += {"completed": ["end exit 0"], "failed": ["end exit 1"],
              "hung": ["hang: no step completed for 600 s after step 90; stack dumps from 8 of 8 ranks in "
                       f"hangs/{job}r0-*.txt", "not retrying (hang): slurm.max_retries (2) reached", "end exit 4"],
              "cancelled": ["cancelled by slipway cancel", "end exit 140"],
              "scancelled": ["cancelled (SIGTERM)", "end exit 143"],
              "requeued": ["retry 1/2 (node failure): requeueing without node2", "end exit 0"],
              }.get(kind, [])
    return [format_event(job, text, stamp(i, k % 60)) for k, text in enumerate(lines)]


def metrics(steps: int) -> str:
    row = {"kind": "train", "step": 0, "loss": 0.0, "lr": 3e-4, "grad_norm": 1.0, "tokens_per_s": 51234.5,
           "mfu": 0.41, "peak_memory_gib": 12.5, "skipped_steps": 0, "eta_s": 600.0, "time": stamp(0)}
    return "".join(json.dumps({**row, "step": s, "loss": 10 - s / 100}) + "\n" for s in range(1, steps + 1))


def make_runs(root: Path, n: int, slurm: StandInSlurm, config_text: str) -> None:
    """N run directories under `root`, and Slurm's record of each run's job."""
    store = root / ".code"
    code = CodeSnapshot(hash="c" * 64, dir=str(store / ("c" * 16)), files=40, bytes=90_000, source="trainer",
                        commit="0" * 40, dirty=False)
    (store / ("c" * 16)).mkdir(parents=True)
    pin = ImagePin("", "", "none")
    short, long_metrics = metrics(30), metrics(7000)
    for i, kind in enumerate(kinds(n)):
        job = str(100_000 + i)
        run = root / f"run{i:05d}"
        (run / "logs").mkdir(parents=True)
        (run / "config.yaml").write_text(config_text)
        big = i % 100 == 99
        manifests.write(run / "manifest.json", Manifest(
            run=run.name, created=stamp(i), project_dir=str(root.parent), git={"commit": "0" * 40, "dirty": False},
            image=pin, runtime="none", launcher="torchrun", config_sha256=hashlib.sha256(config_text.encode()).hexdigest(),
            code=code, submissions=[Launch(job_id=job, submitted=stamp(i), git={"commit": "0" * 40, "dirty": False},
                                           image=pin, code=code, steps=STEPS, script_sha256="s" * 64)]))
        (run / "events.log").write_text("".join(events_of(kind, job, i, 1000 if big else 2)))
        if kind != "queued":
            (run / "metrics.jsonl").write_text(long_metrics if big else short)
        record = {"running": ("RUNNING", "0:0", "None", "ctld"), "queued": ("PENDING", "0:0", "Priority", "ctld"),
                  "requeued": ("PENDING", "0:0", "BeginTime", "ctld"), "completed": ("COMPLETED", "0:0", "None", "acct"),
                  "failed": ("FAILED", "1:0", "None", "acct"), "hung": ("FAILED", "4:0", "None", "acct"),
                  "cancelled": ("CANCELLED", "140:0", "None", "acct"),
                  "scancelled": ("CANCELLED", "0:9", "None", "acct")}.get(kind)
        if record:
            state, exit_code, reason, where = record
            slurm.job(job, state, exit_code, reason=reason, where=where, name=run.name)


FOREIGN_UID = 4242  # a teammate's, as far as file ownership goes


def make_hostile(root: Path) -> None:
    """A damaged run and a teammate's closed one among the others (named to sort among them)."""
    damaged = root / "run00000-damaged"
    shutil.copytree(root / "run00000", damaged)
    (damaged / "manifest.json").write_text('{"submissions": [{"job_id": "1"')
    foreign = root / "run00000-foreign"
    shutil.copytree(root / "run00000", foreign)
    if os.geteuid() == 0:
        for path in (foreign, *foreign.rglob("*")):
            os.chown(path, FOREIGN_UID, FOREIGN_UID, follow_symlinks=False)
        foreign.chmod(0o700)
    else:  # closed to its own user, as a teammate's is
        foreign.chmod(0o000)


def as_a_user() -> list[str]:
    """The prefix that runs a command as an ordinary user would: root without the capabilities
    that let it read any file (permission bits then bind for it too)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return []
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def timed(args: list[str], env: dict, cwd: Path, slurm: StandInSlurm,
          repeat: int) -> tuple[float, float, int, int, int, float, float]:
    """(least CPU seconds of `slipway ARGS` (with the Slurm stand-ins it ran), that run's wall
    seconds, Slurm state calls, lines printed, exit status, peak memory in MiB and the load average
    at its end). The machine is shared: CPU time is what the command costs, wall time follows the load."""
    best = None
    for _ in range(repeat):
        slurm.reset_calls()
        before = os.times()
        start = time.perf_counter()
        with tempfile.NamedTemporaryFile("r") as peak:
            done = subprocess.run([*as_a_user(), "/usr/bin/time", "-q", "-f", "%M", "-o", peak.name, sys.executable,
                                   "-m", "jobs", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL)
            kib = int(peak.read().split()[-1])
        wall = time.perf_counter() - start
        after = os.times()
        cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
        if best is None or cpu < best[0]:
            best = (cpu, wall, len(slurm.state_calls()), done.stdout.count(b"\n"), done.returncode, kib / 1024,
                    os.getloadavg()[0])
    return best


def report(n: int, label: str, name: str, cpu: float, seconds: float, calls: int, lines: int, rc: int, mib: float,
           load: float) -> None:
    print(f"{n:>6} {label:<14} {name:<26} {cpu:>6.2f} {seconds:>8.2f} {load:>5.1f} {mib:>6.0f} {calls:>11} {lines:>6}"
          + (f"  (exit {rc})" if rc else ""), flush=True)


def checkout(ref: str, into: Path) -> Path:
    """slipway's source at git commit `ref`, unpacked into `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,100,1000,10000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", metavar="REF", help="also run slipway at this git commit")
    parser.add_argument("--before-max", type=int, default=1000, help="the largest size --before runs (default 1000)")
    parser.add_argument("--clean", action="store_true", help="no damaged or teammate's run among them")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="slipway-bench-status-"))
    try:
        versions = {"now": ROOT}
        if args.before:
            versions[f"at {args.before}"] = checkout(args.before, work / "before")
        config_text = dump_config(load_config(str(ROOT / "configs" / "tiny_cpu.yaml")))
        print(f"load average before: {os.getloadavg()[0]:.1f}")
        print(f"{'N':>6} {'slipway':<14} {'command':<26} {'CPU s':>6} {'wall s':>8} {'load':>5} {'MiB':>6} "
              f"{'Slurm calls':>11} {'lines':>6}")
        for n in sizes:
            project = work / f"n{n}"
            (project / "configs").mkdir(parents=True)
            shutil.copy(ROOT / "configs" / "tiny_cpu.yaml", project / "configs")
            slurm = StandInSlurm(work / f"slurm{n}")
            make_runs(project / "runs", n, slurm, config_text)
            if not args.clean:
                make_hostile(project / "runs")
            running = next((f"run{i:05d}" for i, k in enumerate(kinds(n)) if k == "running"), "run00000")
            shown = [label for label in versions if label == "now" or n <= args.before_max]
            # Bytecode cached as an installed slipway has it (the first run writes it), beside the runs.
            env = {label: {**{k: v for k, v in slurm.env().items() if k != "PYTHONDONTWRITEBYTECODE"},
                           "PYTHONPATH": str(versions[label]), "SLIPWAY_PROJECT": str(project), "COLUMNS": "200",
                           "PYTHONPYCACHEPREFIX": str(work / f"pycache-{label}")} for label in shown}
            for label in shown:
                subprocess.run([sys.executable, "-m", "jobs", "--help"], env=env[label], capture_output=True)  # bytecode
                # The first listing reads every run and writes its record; the others read the records.
                for name, argv, repeat in (("status (first)", ["status"], 1), ("status", ["status"], args.repeat),
                                           ("status RUN", ["status", "run00000"], args.repeat),
                                           ("watch RUN --once", ["watch", running, "--once"], args.repeat)):
                    report(n, label, name, *timed(argv, env[label], project, slurm, repeat))
            # Last, as each adds a run: a launch prunes the code store (it reads every run's
            # manifest); the next one within the hour does not.
            for label in shown:
                pair = [(float("inf"),), (float("inf"),)]
                for k in range(args.repeat):
                    (project / "runs" / ".code.pruned").unlink(missing_ok=True)
                    for j, best in enumerate(pair):
                        name = f"{'ab'[j]}{k}-{'now' if label == 'now' else 'before'}"
                        result = timed(["submit", "tiny_cpu", "--run-name", name], env[label], project, slurm, 1)
                        pair[j] = min(best, result)
                report(n, label, "submit (prunes)", *pair[0])
                report(n, label, "submit again", *pair[1])
            shutil.rmtree(project)
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
