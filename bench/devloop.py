"""The dev loop in an allocation (issues 41, 46): a one-line code change -> the first training step,
side by side in one run on the real local Slurm, on a GPU-like config: the default tiny_cpu model,
2 nodes x 2 ranks of 2 CPUs each (the batch script's OMP_NUM_THREADS=2, which starts OpenBLAS's
pool at import), the default launcher (srun), the HF environment set as on a cluster without
internet (HF_HOME, HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), gloo:

- `slipway run` without warm processes (launch.warm=false): every rank imports torch;
- `slipway run`, first with warm processes: it starts them (one per node) and its ranks wait for
  their imports;
- `slipway run` again after a one-line change of the checkout's trainer/ (the warm processes
  kept), --repeat times; each says on the terminal whether a rank started cold;
- the hand-written baseline: `srun torchrun` of the same code (the same code snapshot, config,
  environment and container) in the same allocation, as a user would type it;
- `slipway run` cold with each launcher: torchrun (an agent per node) and srun (a task per rank).

Each row is split by the moments its output shows them: the batch script starting (slipway's own
host side), the preflight's node step reporting, the trainer's first line (the ranks imported and
their process group formed), the first training step, and the command's end. The load average
is printed with every row.

    .venv/bin/python bench/devloop.py [--repeat 3]                 # runtime none; root, slurm-wlm, munge
    PATH=ENROOT_BIN:$PATH .venv/bin/python bench/devloop.py --pyxis PLUGIN   # + podman; pyxis: docs/clusters.md, a Slurm cluster on this machine
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jobs.devcluster import ClusterSpec, LocalSlurmCluster, default_state_dir  # noqa: E402

MODEL = ["train.eval_interval=0", "train.warmup_steps=1", "logging.interval=1", "checkpoint.interval=1000",
         "train.steps=2", "slurm.cpus_per_task=2", "--nodes", "2", "--dp", "4"]
HF = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # and HF_HOME, the project's cache
# What each phase's end looks like in the output (the first line that matches), in order.
MARKS = (("script", "$ bash "), ("node step", "slipway-preflight "), ("trainer up", "INFO trainer.train: world"),
         ("first step", "step 1/"))


def timed(argv: list[str], env: dict, cwd: Path, log: Path) -> dict[str, float]:
    """Run `argv`; the seconds from its start to each mark's first line, and to its end."""
    t0 = time.perf_counter()
    seen: dict[str, float] = {}
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(f"{time.perf_counter() - t0:7.3f} {line}")  # when each line came: where the time goes
            for name, mark in MARKS:
                if name not in seen and mark in line:
                    seen[name] = time.perf_counter() - t0
        rc = proc.wait()
    seen["end"] = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{shlex.join(argv[:6])}... exited {rc}: see {log}")
    return seen


def edit(project: Path, i: int) -> None:
    with open(project / "trainer" / "model.py", "a") as f:
        f.write(f"# edit {i}\n")  # a one-line change: a new code snapshot


def inside(project: Path, repeat: int, extra: list[str], out: Path) -> None:
    """In the allocation: the rows, as JSON lines in `out`."""
    os.chdir(project)
    env = {**os.environ, "SLIPWAY_PROJECT": str(project), "COLUMNS": "200", **HF,
           "HF_HOME": str(project / ".cache" / "huggingface")}
    logs = project / "bench-logs"
    logs.mkdir(exist_ok=True)
    rows = []

    def row(what: str, argv: list[str], name: str) -> dict:
        load = os.getloadavg()[0]
        got = timed(argv, env, project, logs / f"{name}.out")
        got.update(what=what, load=(load + os.getloadavg()[0]) / 2,
                   cold=sum("started cold" in line for line in (logs / f"{name}.out").read_text().splitlines()))
        rows.append(got)
        with out.open("a") as f:
            f.write(json.dumps(got) + "\n")
        return got

    run = [sys.executable, "-m", "jobs", "run", "tiny_cpu", *MODEL, *extra]
    edit(project, 0)
    row("slipway run, no warm processes", [*run, "--run-name", "cold", "launch.warm=false"], "cold")
    edit(project, 1)
    row("slipway run, first (starts them)", [*run, "--run-name", "first"], "first")
    for i in range(repeat):
        edit(project, 2 + i)
        row("code change -> slipway run, warm", [*run, "--run-name", f"warm-{i}"], f"warm-{i}")
        row("hand-written srun torchrun", baseline(project, f"warm-{i}", f"base-{i}", extra), f"base-{i}")
        for launcher in ("torchrun", "srun"):  # issue 41 item 2: the launchers side by side, both cold
            edit(project, 100 + i)
            row(f"cold, launch.launcher {launcher}", [*run, "--run-name", f"{launcher}-{i}", "launch.warm=false",
                                                      f"launch.launcher={launcher}"], f"{launcher}-{i}")
    subprocess.run([sys.executable, "-m", "jobs", "run", "--stop-warm"], env=env, cwd=project, check=True)


def baseline(project: Path, like: str, name: str, extra: list[str]) -> list[str]:
    """`srun torchrun` of run `like`'s code snapshot and config (a run directory of its own), in
    the same container (pyxis: the build's container kept on the nodes, with the mounts slipway
    gives a run): the command a user would write."""
    import re

    from edf import srun_flags
    from jobs import runs
    from jobs.config import load_config

    src, dst = project / "runs" / like, project / "runs" / name
    dst.mkdir(parents=True)
    shutil.copy(src / "config.yaml", dst / "config.yaml")
    code = json.loads((src / "manifest.json").read_text())["code"]["dir"]
    cfg = load_config("tiny_cpu", [*[a for a in MODEL if "=" in a], "slurm.nodes=2", "parallel.dp=4", *extra,
                                   f"run.name={name}"])
    sealed = runs.seal(cfg, project, dry_run=True)
    assert sealed.snapshot is not None and sealed.snapshot.dir == code, "the baseline would run other code"
    flags, exports = srun_flags(sealed.env, sealed.paths.env_toml).expanded() if sealed.env.in_container else ([], {})
    kept = re.search(r"CONTAINER_PREFIX=(\S+) CONTAINER_BUILD=(\S+)", (src / "job.sbatch").read_text())
    if kept and kept.group(2) != "''":
        flags.append(f"--container-name={kept.group(1)}{kept.group(2)}:no_exec")
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True).stdout.split()
    env = [f"{k}={v}" for k, v in {**exports, "PYTHONPATH": code, "SLIPWAY_CODE": code, "PYTHONSAFEPATH": "1",
                                    "SLIPWAY_RUN_DIR": str(dst), "OMP_NUM_THREADS": "2"}.items()]
    return ["env", *env, "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=4", *flags,
            cfg.launch.python, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes[0]}:{29400 + os.getpid() % 1000}",
            f"--rdzv-id={name}", "-m", "trainer", "--config", str(dst / "config.yaml")]


def report(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    heads = [name for name, _ in MARKS] + ["end"]
    print(f"{'launch':36s} " + " ".join(f"{h:>11s}" for h in heads) + "   load")
    for what in dict.fromkeys(r["what"] for r in rows):
        group = [r for r in rows if r["what"] == what]
        cells = []
        for h in heads:
            values = [r[h] for r in group if h in r]
            cells.append(f"{statistics.median(values):11.2f}" if values else f"{'-':>11s}")
        print(f"{what:36s} " + " ".join(cells) + f"   {statistics.median(r['load'] for r in group):.1f}"
              + f"  (n={len(group)})")
    cold = sum(r.get("cold", 0) for r in rows if not r["what"].startswith(("cold", "slipway run, no", "hand")))
    print(f"warm runs whose terminal said a rank started cold: {cold}")
    warm = [r["first step"] for r in rows if r["what"].startswith("code change")]
    base = [r["first step"] for r in rows if r["what"].startswith("hand-written")]
    if warm and base:
        print(f"code change -> first step, warm: {statistics.median(warm):.2f} s; "
              f"{statistics.median(warm) / statistics.median(base):.2f}x the hand-written srun torchrun")
        # Each warm launch beside the hand-written one run right after it, under the same load.
        pairs = [w / b for w, b in zip(warm, base)]
        print(f"each warm launch over the hand-written one after it: {' '.join(f'{p:.2f}x' for p in pairs)} "
              f"(median {statistics.median(pairs):.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pyxis", metavar="PLUGIN", type=lambda p: str(Path(p).resolve()),
                        help="under real pyxis, with this spank_pyxis.so")
    parser.add_argument("--inside", nargs=2, metavar=("PROJECT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--extra", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(Path(args.inside[0]), args.repeat, shlex.split(args.extra), Path(args.inside[1]))
        return
    tmp = Path(tempfile.mkdtemp(prefix="slipway-bench-devloop-"))
    project = tmp / "project"
    shutil.copytree(ROOT / "configs", project / "configs")
    for name in ("common", "trainer"):
        shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    extra, plugstack, private = [], None, ()
    if args.pyxis:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_image import TEST_BASE, ensure_test_base, ensure_wheelhouse

        ensure_test_base()
        extra = ["container.runtime=pyxis", f"image.base_image={TEST_BASE}", "image.flash_attn=false",
                 f"image.wheelhouse={ensure_wheelhouse()}", "image.isolation=chroot",
                 f"image.output_dir={tmp / 'images'}", "image.squash_options=-comp lz4"]
        subprocess.run([sys.executable, "-m", "jobs", "image", "build", "tiny_cpu", *extra], cwd=ROOT, check=True,
                       capture_output=True)
        plugstack = tmp / "plugstack.conf"
        plugstack.write_text(f"required {args.pyxis} runtime_path={tmp / 'pyxis-runtime'}\n")
        private = (str(tmp / "pyxis-runtime"), "/run/enroot", "/root/.local/share/enroot", "/root/.cache/enroot")
    cluster = LocalSlurmCluster(ClusterSpec(
        state_dir=default_state_dir("bench-devloop"), nodes=2, name="slpwd", node_prefix="slpwd-node",
        ctl_host="slpwd-ctl", subnet="10.213.6", ctld_port=6987, slurmd_port=6988, plugstack=plugstack,
        node_private=private))
    out = tmp / "rows.jsonl"
    cluster.up()
    try:
        env = {**os.environ, **cluster.env()}
        env.pop("SLIPWAY_RUNS", None)
        # As a user's shell has it: a module compiled once is cached in the snapshot for the other ranks.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        subprocess.run(["salloc", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=2", sys.executable,
                        __file__, "--inside", str(project), str(out), "--repeat", str(args.repeat), "--extra",
                        shlex.join(extra)], env=env, check=True)
    finally:
        cluster.down(check=False)
    print(f"machine: {os.cpu_count()} cores; logs in {project / 'bench-logs'}")
    report(out)


if __name__ == "__main__":
    main()
