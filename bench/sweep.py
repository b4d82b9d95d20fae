"""A sweep of N points (default 1,000: a 10 x 10 x 10 grid), through the CLI as a user types it,
against a stand-in Slurm that counts its calls (tests/slurm_standin.py): `slipway sweep --dry-run`,
the submission (one array, or several under a smaller MaxArraySize), the re-run that finds every
point queued, then `status SWEEP` and `compare SWEEP` once every point has its metrics (a train
record a step and an eval record every tenth) and Slurm's record of its task (one in ten still
running, the others ended as events.log says).

Targets (issue 50): the dry run of 10,000 points and compare of 1,000 at most 1 s of CPU each on
the 2-core development machine, at most two Slurm calls for the sweep's status ("Slurm calls"
counts squeue, sacct and `scontrol show job`); "MiB" is a command's peak memory.

    python bench/sweep.py [--points 1000] [--repeat 3] [--max-array-size 1001] [--one-axis]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(ROOT), str(ROOT / "tests")]

from slurm_standin import StandInSlurm  # noqa: E402

STEPS = 200


def axes(n: int, one: bool = False) -> list[str]:
    """A grid of n points: an axis of ten values for each power of ten (1,000: train.lr,
    train.warmup_steps, run.seed; 10,000: and train.beta2), or (`one`, or n no power of ten) one
    axis of n values."""
    count = round(math.log10(n))
    if one or 10 ** count != n or count > 4:
        return [f"train.lr=[{', '.join(f'{(i + 30) * 1e-5:.5g}' for i in range(n))}]"]
    return [f"train.lr=[{', '.join(f'{(i + 3) * 1e-4:.4g}' for i in range(10))}]",
            f"train.warmup_steps=[{', '.join(str(10 + i) for i in range(10))}]",
            f"run.seed=[{', '.join(str(i) for i in range(10))}]",
            f"train.beta2=[{', '.join(f'0.9{i}' for i in range(10))}]"][:count]


def timed(argv: list[str], env: dict, cwd: Path, slurm: StandInSlurm,
          repeat: int) -> tuple[float, float, float, float, int, int, str]:
    """(least CPU seconds of a run (with its Slurm stand-ins'), that run's wall seconds, the load
    average at its end, its peak memory in MiB, its Slurm state calls, exit status and output).
    The machine is shared: CPU time is what the command costs, wall time follows the load."""
    best = None
    for _ in range(repeat):
        slurm.reset_calls()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        with tempfile.NamedTemporaryFile("r") as peak:
            r = subprocess.run(["/usr/bin/time", "-q", "-f", "%M", "-o", peak.name, sys.executable, "-m", "jobs", *argv],
                               cwd=cwd, env=env, capture_output=True, text=True)
            kib = int(peak.read().split()[-1])
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if best is None or cpu < best[0]:
            best = (cpu, wall, os.getloadavg()[0], kib / 1024, len(slurm.state_calls()), r.returncode,
                    r.stdout + r.stderr)
    return best


def report(name: str, cpu: float, seconds: float, load: float, mib: float, calls: int, rc: int, out: str) -> None:
    print(f"{name:<30} {cpu:>8.2f} {seconds:>8.2f} {load:>5.1f} {mib:>6.0f} {calls:>11}"
          + (f"  (exit {rc}: {out[-300:]})" if rc else ""), flush=True)


def ended(project: Path, slurm: StandInSlurm) -> int:
    """Every point's metrics, and its task's end in events.log and Slurm; returns the number of points."""
    record = json.loads((project / "runs" / ".sweeps" / "b" / "sweep.json").read_text())
    n = 0
    for array in record["arrays"]:
        for i, run in enumerate(array["points"]):
            task = f"{array['job_id']}_{i}"
            lines = []
            for step in range(1, STEPS + 1):
                lines.append(json.dumps({"kind": "train", "step": step, "loss": 10 - step / 50 - n / 1e4,
                                         "tokens_per_s": 51234.5, "mfu": 0.41, "lr": 3e-4, "grad_norm": 1.0}))
                if step % 10 == 0:
                    lines.append(json.dumps({"kind": "eval", "step": step, "eval_loss": 10.5 - step / 50 - n / 1e4}))
            (project / "runs" / run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
            running = n % 10 == 9  # one task in ten still runs: Slurm is asked about those alone
            with open(project / "runs" / run / "events.log", "a") as f:
                f.write(f"2026-01-01T00:00:00+00:00 job {task} start on node1 (restart 0)\n"
                        + ("" if running else f"2026-01-01T00:10:00+00:00 job {task} end exit 0\n"))
            slurm.job(task, "RUNNING" if running else "COMPLETED", where="ctld" if running else "acct", name="b")
            n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-array-size", type=int, default=1001)
    parser.add_argument("--one-axis", action="store_true", help="one axis of --points values, not a grid of tens")
    parser.add_argument("--dry-run-only", action="store_true", help="the dry run alone")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slipway-bench-sweep-"))
    try:
        project = work / "project"
        (project / "configs").mkdir(parents=True)
        shutil.copy(ROOT / "configs" / "tiny_cpu.yaml", project / "configs")
        slurm = StandInSlurm(work / "slurm")
        (slurm.root / "max-array-size").write_text(str(args.max_array_size))
        # Bytecode cached as an installed slipway has it (the first command writes it).
        env = {**{k: v for k, v in slurm.env().items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPATH": str(ROOT),
               "SLIPWAY_PROJECT": str(project), "COLUMNS": "80", "PYTHONPYCACHEPREFIX": str(work / "pycache")}
        subprocess.run([sys.executable, "-m", "jobs", "--help"], env=env, capture_output=True)
        sweep = ["sweep", "tiny_cpu", "--name", "b", *axes(args.points, args.one_axis), "--max-parallel", "50"]
        print(f"load average before: {os.getloadavg()[0]:.1f}; {args.points} points, MaxArraySize "
              f"{args.max_array_size}")
        print(f"{'command':<30} {'CPU s':>8} {'wall s':>8} {'load':>5} {'MiB':>6} {'Slurm calls':>11}")
        report("sweep --dry-run", *timed([*sweep, "--dry-run"], env, project, slurm, args.repeat))
        if args.dry_run_only:
            return
        result = timed(sweep, env, project, slurm, 1)
        report("sweep (writes, submits)", *result)
        print("  " + " / ".join([line for line in result[-1].splitlines() if line.startswith(("sweep b", "submitted"))][:3]))
        report("sweep again (all queued)", *timed(sweep, env, project, slurm, args.repeat))
        n = ended(project, slurm)
        report("status SWEEP (first)", *timed(["status", "b"], env, project, slurm, 1))  # writes the records
        report("status SWEEP", *timed(["status", "b"], env, project, slurm, args.repeat))
        report("compare SWEEP", *timed(["compare", "b"], env, project, slurm, args.repeat))
        report("compare SWEEP --csv", *timed(["compare", "b", "--csv"], env, project, slurm, args.repeat))
        report("sweep again (all finished)", *timed(sweep, env, project, slurm, args.repeat))
        print(f"load average after: {os.getloadavg()[0]:.1f}; {n} points ended")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
