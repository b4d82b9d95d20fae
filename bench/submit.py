"""How long the login-node side takes: CLI import time and `slipway submit --dry-run` wall time.

Prints one table; run with `make bench` or `.venv/bin/python bench/submit.py [--repeat N]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(argv: list[str], repeat: int) -> list[float]:
    times = []
    env = {**os.environ, "SLIPWAY_RUNS": str(ROOT / ".cache" / "bench-runs")}
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    py = sys.executable
    cases = {
        "python -c pass (interpreter start)": [py, "-c", "pass"],
        "import jobs.cli": [py, "-c", "import jobs.cli"],
        "import host side (jobs, edf, containers)": [py, "-c", "import jobs.cli, jobs.runs, edf, containers"],
        "slipway --help": [py, "-m", "jobs", "--help"],
        "slipway submit tiny_cpu --dry-run": [py, "-m", "jobs", "submit", "tiny_cpu", "--dry-run"],
        "slipway submit tiny_wikitext --dry-run": [py, "-m", "jobs", "submit", "tiny_wikitext", "--dry-run"],
    }
    torch_free = subprocess.run([py, "-c", "import sys, jobs.cli, jobs.runs, edf; sys.exit('torch' in sys.modules)"],
                                cwd=ROOT).returncode == 0
    print(f"{'case':45s} {'median s':>9s} {'min s':>8s}  (n={args.repeat})")
    for name, argv in cases.items():
        t = timed(argv, args.repeat)
        print(f"{name:45s} {statistics.median(t):9.3f} {min(t):8.3f}")
    print(f"host side imports torch: {'no' if torch_free else 'YES'}")


if __name__ == "__main__":
    main()
