"""What a node's check of a job costs (jobs/slurm/job_lib.sh verify_code, verify_image): the
real bash functions over a real code snapshot of this checkout, and over a squashfs-sized file.

- the code snapshot a `tiny_cpu` submission writes (common/ and trainer/), checked whole;
- an image whose size and mtime are as recorded (the check every job makes);
- an image touched since submission, whose bytes must then be hashed (per GB);
- for scale, the batch script's start: `bash` sourcing the job library.

    .venv/bin/python bench/verify.py [--repeat 10] [--image-gb 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobs.runs.code import plan_snapshot  # noqa: E402
from jobs.slurm.script import LIBRARIES  # noqa: E402


def timed(script: str, repeat: int) -> float:
    """The median seconds of `bash -c` running the job library, then `script`."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(["bash", "-c", LIBRARIES["job_lib"] + LIBRARIES["verify_lib"] + "\n" + script], check=True,
                       stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--image-gb", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        code = plan_snapshot(Path(tmp) / "runs" / ".code", None, ROOT).write()
        image = Path(tmp) / "image.sqsh"
        with open(image, "wb") as f:  # real bytes: a sparse file would hash faster than any squashfs
            block = os.urandom(1 << 20)
            for _ in range(int(args.image_gb * 1024)):
                f.write(block)
        st = image.stat()
        base = timed("true", args.repeat)
        rows = [
            ("bash sourcing the job library (for scale)", base),
            (f"verify_code: the tiny_cpu snapshot ({code.files} files, {code.bytes / 1e6:.1f} MB)",
             timed(f"verify_code '{code.dir}' {code.hash}", args.repeat) - base),
            ("verify_image: size and mtime as recorded", timed(
                f"verify_image '{image}' '' {st.st_size} {int(st.st_mtime)}", args.repeat) - base),
        ]
        sha = subprocess.run(["sha256sum", str(image)], capture_output=True, text=True, check=True).stdout.split()[0]
        hashed = timed(f"verify_image '{image}' {sha} {st.st_size} {int(st.st_mtime) - 1}", max(2, args.repeat // 5))
        rows.append((f"verify_image: touched since submission, bytes hashed (per GB, {args.image_gb:g} GB)",
                     (hashed - base) / args.image_gb))
    print(f"{'what':78s} {'seconds (median)':>16s}")
    for what, seconds in rows:
        print(f"{what:78s} {seconds:16.3f}")


if __name__ == "__main__":
    main()
