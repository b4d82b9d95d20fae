"""A no-op `make image` against a full rebuild, side by side.

Builds the image once if needed, then times: `build_image` with nothing
changed (in process, and as the whole `slipway image build` process that
`make image` runs), and `build_image(force=True)` (podman without its layer
cache, then the import). Run from the repository root, e.g. on this project's
development machines (no registry, no enroot):

    .venv/bin/python bench/image.py tiny_cpu --base-image localhost/slipway-testbase:py311 \\
        image.flash_attn=false image.wheelhouse=.cache/wheelhouse image.isolation=chroot --enroot-standin

(`tests/test_image.py -m podman` makes that base image and wheelhouse.)
`--enroot-standin` puts the test suite's enroot stand-in first on PATH where no
enroot is installed: it imports as enroot's podman:// path does (podman create,
export, mksquashfs with ENROOT_SQUASH_OPTIONS, the container left behind for
slipway to remove), so the import figure is indicative only.
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

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from containers.image import build_image, human  # noqa: E402
from containers.tools import which  # noqa: E402
from jobs.config import load_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="tiny_cpu")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--base-image")
    parser.add_argument("--repeat", type=int, default=5, help="no-op runs to take the median of")
    parser.add_argument("--no-import", action="store_true", help="time podman only (no enroot)")
    parser.add_argument("--enroot-standin", action="store_true",
                        help="where enroot is missing, import with the test suite's stand-in")
    args = parser.parse_intermixed_args()
    os.chdir(ROOT)
    console = Console()
    quiet = Console(quiet=True)
    if args.enroot_standin and which("enroot") is None:
        from tests.image_standins import write_standins

        bin_dir = write_standins(Path(tempfile.mkdtemp(prefix="slipway-bench-bin-")), "enroot")
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        os.environ["FAKE_ENROOT_MODE"] = "real"
        console.print(f"enroot: the test stand-in ({bin_dir}/enroot), not the real tool")
    sets = {"image.base_image": args.base_image} if args.base_image else None
    cfg = load_config(args.config, args.overrides, sets)
    do_import = not args.no_import

    first = build_image(cfg, do_import=do_import, console=console)
    console.print(f"initial: built={first.built} imported={'import' in first.timings} in {first.seconds:.1f} s")

    noop = [build_image(cfg, do_import=do_import, console=quiet) for _ in range(args.repeat)]
    assert not any(r.built for r in noop), "a no-op build rebuilt: the tree changed while benchmarking"
    noop_s = statistics.median(r.seconds for r in noop)
    cli = [sys.executable, "-m", "jobs", "image", "build", args.config, *args.overrides]
    cli += ["--base-image", args.base_image] if args.base_image else []
    cli += [] if do_import else ["--no-import"]
    cli_times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        subprocess.run(cli, check=True, capture_output=True)
        cli_times.append(time.perf_counter() - t0)
    cli_s = statistics.median(cli_times)

    full = build_image(cfg, force=True, do_import=do_import, console=console)

    table = Table(title=f"image build: no-op vs full rebuild ({full.plan.tag})")
    for col in ("case", "seconds", "podman", "what ran"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    what_noop = "hash the context; squashfs found" if do_import else "hash the context; `podman image exists`"
    table.add_row(f"no-op build_image (median of {args.repeat})", f"{noop_s:.3f}",
                  "not run" if do_import else "image exists", what_noop)
    table.add_row(f"no-op `slipway image build` (median of {args.repeat})", f"{cli_s:.3f}",
                  "not run" if do_import else "image exists", "interpreter start + the same")
    t = full.timings
    detail = f"podman build --no-cache {t.get('build', 0):.1f} s"
    if do_import:
        detail += f" + import {t.get('import', 0):.1f} s -> {human(full.record.size_bytes if full.record else 0)}"
    table.add_row("full rebuild (--force)", f"{full.seconds:.1f}", "build", detail)
    console.print(table)
    console.print(f"speed-up of a no-op over a rebuild: {full.seconds / max(cli_s, 1e-9):.0f}x "
                  f"({os.cpu_count()} cores, {'with' if do_import else 'without'} import)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
