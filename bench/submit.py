"""How long the login-node side takes: CLI import time and `slipway submit --dry-run` wall time,
and what the secret policy costs in them (common/secrets.py: detect-secrets loaded once per
process, every string of a config judged, every file of a code snapshot scanned unless its content
was found clean before).

Prints two tables; run with `make bench` or `.venv/bin/python bench/submit.py [--repeat N]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(argv: list[str], repeat: int) -> list[float]:
    times = []
    # tiny_wikitext mounts ${SCRATCH}, which a cluster's login shell sets
    env = {"SCRATCH": "/tmp", **os.environ, "SLIPWAY_RUNS": str(ROOT / ".cache" / "bench-runs")}
    for _ in range(repeat):
        start = time.perf_counter()
        rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        times.append(time.perf_counter() - start)
        if rc not in (0, 2):  # 2: a dry run that would be refused (no image built here, say), timed all the same
            raise SystemExit(f"{' '.join(argv[2:5])} exited {rc}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--configs", type=int, default=50, help="configs per round of the policy's per-config case")
    parser.add_argument("--image-gib", type=float, default=0,
                        help="also time a launch on a squashfs of the user's of this size: its first, then remembered")
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
    print()
    if args.image_gib:
        own_image(args.image_gib, args.repeat)
        print()
    secret_policy(args.repeat, args.configs)


def own_image(gib: float, repeat: int) -> None:
    """`slipway submit --dry-run` on a squashfs slipway did not build (pinned by its bytes' sha256,
    jobs/runs/image.py): a first launch reads it whole, the next ones find its digest remembered."""
    with tempfile.TemporaryDirectory(prefix="slipway-bench-image-") as tmp:
        image = Path(tmp) / "own.sqsh"
        with image.open("wb") as f:
            for _ in range(int(gib * 1024)):
                f.write(os.urandom(1 << 20))
        argv = [sys.executable, "-m", "jobs", "submit", "tiny_cpu", "container.runtime=pyxis",
                f"container.image={image}", "--dry-run"]
        first, again = [], []
        for i in range(repeat):
            os.environ["XDG_CACHE_HOME"] = f"{tmp}/cache-{i}"  # a cache of its own: the first launch reads it all
            first += timed(argv, 1)
            again += timed(argv, 1)
        os.environ.pop("XDG_CACHE_HOME")
    for name, t in ((f"squashfs of the user's, {gib:g} GiB: first launch", first), ("... its digest remembered", again)):
        print(f"{name:45s} {statistics.median(t):9.3f} {min(t):8.3f}")


# The detector's first use in a fresh process (importing detect-secrets and its detectors).
_FIRST_USE = ("import time, common.secrets as s; t = time.perf_counter(); s.find_secrets('x'); "
              "print(time.perf_counter() - t)")


def secret_policy(repeat: int, configs: int) -> None:
    """The policy's cost: per config (its strings judged as they are read), per message, and the
    content scan of a code snapshot and of the image's sources, cold and kept by content."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("SCRATCH", "/tmp")
    from common import schema, secrets
    from containers.context import CONTEXT_DIRS
    from containers.sources import MAX_BYTES, MAX_FILES, Folder, collect
    from jobs.config import load_config
    from jobs.runs.code import plan_snapshot

    rows = []
    first = [float(subprocess.run([sys.executable, "-c", _FIRST_USE], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout) for _ in range(repeat)]
    rows.append(("detector's first use in a process (detect-secrets loaded)", first, "s"))
    def cold() -> None:  # every judgment made anew, as for a config of values never seen
        schema._refusal.cache_clear()

    def policy_off(work):
        def run():
            real, schema.refusal = schema.refusal, lambda *a, **k: None
            try:
                work()
            finally:
                schema.refusal = real
        return run

    seeds = iter(range(10 ** 9))
    message = ("container.env.HF_TOKEN: looks like a secret (its name ends in TOKEN), and a value given here "
               "is written into the run directory: export it and pass it by name")
    cases = []
    for name in ("tiny_wikitext", "tiny_cpu"):
        load_config(name)
        cases += [(f"{name}: read and validated, policy on, nothing seen before", lambda n=name: (cold(), load_config(n))),
                  (f"{name}: the same, a sweep's point (one value new)",
                   lambda n=name: load_config(n, [f"run.seed={next(seeds)}"])),
                  (f"{name}: the same, no value judged (policy off)", policy_off(lambda n=name: (cold(), load_config(n))))]
    cases.append(("mask() of a 170-character message, never seen before", lambda: (cold(), secrets.mask(message))))
    # Interleaved, round by round: a loaded machine's swings fall on every case alike.
    times: dict[str, list[float]] = {label: [] for label, _ in cases}
    for _ in range(max(5, repeat)):
        for label, work in cases:
            times[label].append(_timed(lambda: [work() for _ in range(configs)]) / configs)
    rows += [(label, times[label], "ms") for label, _ in cases]
    cache = Path(tempfile.mkdtemp(prefix="slipway-bench-"))
    try:
        os.environ["XDG_CACHE_HOME"] = str(cache / "cache")
        store = cache / "runs" / ".code"
        folders = [Folder(ROOT / top, f"src/{top}") for top in CONTEXT_DIRS if (ROOT / top).is_dir()]
        for label, work in (("code snapshot (common/, trainer/)", lambda: plan_snapshot(store, None, ROOT)),
                            ("image sources (the build context's folders)",
                             lambda: collect(folders, field_name="image", max_bytes=MAX_BYTES, max_files=MAX_FILES))):
            cold = []
            for _ in range(max(2, repeat // 3)):
                shutil.rmtree(cache / "cache", ignore_errors=True)
                cold.append(_timed(work))
            rows.append((f"{label}: planned, every file scanned", cold, "s"))
            rows.append((f"{label}: planned again, unchanged (kept)", [_timed(work) for _ in range(repeat)], "s"))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"{'secret policy case':60s} {'median':>9s} {'min':>8s}")
    for name, times, unit in rows:
        scale = 1000 if unit == "ms" else 1
        print(f"{name:60s} {statistics.median(times) * scale:7.3f}{unit:>2s} {min(times) * scale:6.3f}{unit:>2s}")
    point, off = (statistics.median(rows[i][1]) * 1000 for i in (2, 3))
    print(f"a sweep of 1,000 tiny_wikitext points validated: about {point:.1f} s (without judging values "
          f"{off:.1f} s)")


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start




if __name__ == "__main__":
    main()
