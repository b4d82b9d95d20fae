"""A sweep of N points (default 1,000: a 10 x 10 x 10 grid), through the CLI as a user types it,
against a stand-in Slurm that counts its calls (tests/slurm_standin.py): `slipway sweep --dry-run`,
the submission (one array, or several under a smaller MaxArraySize), the re-run that finds every
point queued, then `status SWEEP` and `compare SWEEP` once every point has its metrics (a train
record a step and an eval record every tenth) and Slurm's record of its task (one in ten still
running, the others ended as events.log says).

Targets (issue 36): the dry run and compare under 2 s each on the development machine, at most two
Slurm calls for the sweep's status ("Slurm calls" counts squeue, sacct and `scontrol show job`).

    python bench/sweep.py [--points 1000] [--repeat 3] [--max-array-size 1001]
"""

from __future__ import annotations

import argparse
import json
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


def axes(n: int) -> list[str]:
    """Three axes whose grid has n points (n a cube), or one axis of n values."""
    side = round(n ** (1 / 3))
    if side ** 3 != n:
        return [f"train.lr=[{', '.join(f'{(i + 30) * 1e-5:.5g}' for i in range(n))}]"]
    return [f"train.lr=[{', '.join(f'{(i + 3) * 1e-4:.4g}' for i in range(side))}]",
            f"train.warmup_steps=[{', '.join(str(10 + i) for i in range(side))}]",
            f"run.seed=[{', '.join(str(i) for i in range(side))}]"]


def timed(argv: list[str], env: dict, cwd: Path, slurm: StandInSlurm,
          repeat: int) -> tuple[float, float, int, int, str]:
    """(best wall seconds, CPU seconds of that run (with its Slurm stand-ins'), Slurm state calls of
    the last run, its exit status, its output). The machine is shared: CPU time says what wall
    time would be on an idle one."""
    best, cpu, calls, rc, out = float("inf"), 0.0, 0, 0, ""
    for _ in range(repeat):
        slurm.reset_calls()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "jobs", *argv], cwd=cwd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if wall < best:
            best, cpu = wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        calls, rc, out = len(slurm.state_calls()), r.returncode, r.stdout + r.stderr
    return best, cpu, calls, rc, out


def report(name: str, seconds: float, cpu: float, calls: int, rc: int, out: str) -> None:
    print(f"{name:<30} {seconds:>8.2f} {cpu:>8.2f} {calls:>11}" + (f"  (exit {rc}: {out[-300:]})" if rc else ""),
          flush=True)


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
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slipway-bench-sweep-"))
    try:
        project = work / "project"
        (project / "configs").mkdir(parents=True)
        shutil.copy(ROOT / "configs" / "tiny_cpu.yaml", project / "configs")
        slurm = StandInSlurm(work / "slurm")
        (slurm.root / "max-array-size").write_text(str(args.max_array_size))
        env = {**slurm.env(), "PYTHONPATH": str(ROOT), "SLIPWAY_PROJECT": str(project), "COLUMNS": "80"}
        sweep = ["sweep", "tiny_cpu", "--name", "b", *axes(args.points), "--max-parallel", "50"]
        print(f"load average before: {os.getloadavg()[0]:.1f}; {args.points} points, MaxArraySize "
              f"{args.max_array_size}")
        print(f"{'command':<30} {'wall s':>8} {'CPU s':>8} {'Slurm calls':>11}")
        report("sweep --dry-run", *timed([*sweep, "--dry-run"], env, project, slurm, args.repeat))
        seconds, cpu, calls, rc, out = timed(sweep, env, project, slurm, 1)
        report("sweep (writes, submits)", seconds, cpu, calls, rc, out)
        print("  " + " / ".join([line for line in out.splitlines() if line.startswith(("sweep b", "submitted"))][:3]))
        report("sweep again (all queued)", *timed(sweep, env, project, slurm, args.repeat))
        n = ended(project, slurm)
        report("status SWEEP", *timed(["status", "b"], env, project, slurm, args.repeat))
        report("compare SWEEP", *timed(["compare", "b"], env, project, slurm, args.repeat))
        report("compare SWEEP --csv", *timed(["compare", "b", "--csv"], env, project, slurm, args.repeat))
        report("sweep again (all finished)", *timed(sweep, env, project, slurm, args.repeat))
        print(f"load average after: {os.getloadavg()[0]:.1f}; {n} points ended")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
