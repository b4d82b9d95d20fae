"""End to end on the local Slurm cluster of `slipway cluster`: the time from
`slipway submit` to the first training step (the first metrics.jsonl line), and
weak scaling from 1 to 2 nodes (the same per-process batch; tokens/s per process
at 2 nodes divided by tokens/s per process at 1 node).

One process per node, so the 2-node run uses as many cores as there are
processes (the local "nodes" share this machine's cores).

With --dev-loop, the dev loop instead (runtime none, 2 nodes, one process each): a one-line
change in the checkout's trainer/ -> the first training step of a new submission (the code
snapshot: no image rebuild), and `slipway run` twice in one allocation -> its first step, each
split into where the time goes (from events.log and the launcher's clock).

With --pyxis PLUGIN (a built spank_pyxis.so, enroot on PATH; see the lab notes), the same
under real pyxis on a 2-node cluster of its own: the first job of an image build (it unpacks
the image on both nodes), a code change -> a new submission of that build (the container kept
on the nodes: nothing unpacked), and a SIGKILLed rank -> the job's end, with the build's
container kept and with a container of the job's own (container.keep_builds=0) removed at its
end.

    .venv/bin/python bench/e2e.py [--steps 30] [--repeat 2]     # needs root, slurm-wlm, munge
    .venv/bin/python bench/e2e.py --dev-loop [--repeat 3]
    .venv/bin/python bench/e2e.py --pyxis PLUGIN [--repeat 3]  # also podman
"""

from __future__ import annotations

import argparse
import json
import os
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

MODEL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "data.seq_len=64", "model.max_position_embeddings=64",
         "train.micro_batch_size=8", "train.eval_interval=0", "train.warmup_steps=2", "logging.interval=1",
         "checkpoint.interval=1000", "launch.procs_per_node=1", "--cpus-per-task", "1"]


def train_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "train"]


def one_run(project: Path, name: str, nodes: int, steps: int, env: dict[str, str]) -> tuple[float, float]:
    """(seconds from submit to the first metrics line, median tokens/s per process after step 2)."""
    metrics = project / "runs" / name / "metrics.jsonl"
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jobs", "submit", "tiny_cpu", "--parsable", "--run-name", name,
                          "--nodes", str(nodes), "--dp", str(nodes), f"train.steps={steps}", *MODEL],
                         cwd=project, env=env, capture_output=True, text=True, check=True)
    job_id = out.stdout.strip()
    while not train_records(metrics):
        time.sleep(0.05)
        if time.perf_counter() - start > 300:
            raise SystemExit(f"no training step after 300 s: see {project / 'runs' / name}")
    first_step = time.perf_counter() - start
    while len(train_records(metrics)) < steps:
        time.sleep(0.2)
    while subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True).stdout.strip():
        time.sleep(0.2)
    tps = [r["tokens_per_s_per_device"] for r in train_records(metrics)[2:]]
    return first_step, statistics.median(tps)


def _event_times(run_dir: Path) -> dict[str, float]:
    """The first time (epoch s) each event kind appears in events.log: start, preflight ok, end."""
    from common.events import read_events

    out: dict[str, float] = {}
    for e in read_events(run_dir):
        key = "start" if e.text.startswith("start ") else "preflight" if e.text.startswith("preflight") else None
        if key and e.when and key not in out:
            out[key] = e.when.timestamp()
    return out


def _first_step(metrics: Path, start: float, limit: float = 300) -> float:
    while not train_records(metrics):
        time.sleep(0.02)
        if time.perf_counter() - start > limit:
            raise SystemExit(f"no training step after {limit:.0f} s: see {metrics.parent}")
    return time.perf_counter() - start


def dev_loop(project: Path, env: dict[str, str], repeat: int) -> None:
    for name in ("common", "trainer"):
        shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    layout = ["--nodes", "2", "--dp", "2", "train.steps=3", *MODEL]
    rows: list[tuple[str, float, float, float]] = []  # (what, command returns, job start, first step)
    for i in range(repeat):
        with open(project / "trainer" / "model.py", "a") as f:
            f.write(f"# edit {i}\n")  # a one-line code change: a new snapshot, no rebuild
        name = f"change-{i}"
        wall0, t0 = time.time(), time.perf_counter()
        subprocess.run([sys.executable, "-m", "jobs", "submit", "tiny_cpu", "--parsable", "--run-name", name,
                        *layout], cwd=project, env=env, capture_output=True, text=True, check=True)
        returned = time.perf_counter() - t0
        first = _first_step(project / "runs" / name / "metrics.jsonl", t0)
        events = _event_times(project / "runs" / name)
        rows.append(("code change -> submit", returned, events.get("start", wall0) - wall0,
                     events.get("preflight", float("nan")) - wall0, first))
        while subprocess.run(["squeue", "-h", "-n", name], env=env, capture_output=True, text=True).stdout.strip():
            time.sleep(0.2)
    alloc = subprocess.run(["salloc", "--nodes=2", "--no-shell"], env=env, capture_output=True, text=True, check=True)
    job = alloc.stderr.split("Granted job allocation ")[1].split()[0]
    info = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True).stdout
    nodelist = next(w.split("=", 1)[1] for w in info.split() if w.startswith("NodeList="))
    inside = {**env, "SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_JOB_NODELIST": nodelist,
              "SLURM_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2"}
    try:
        for i in range(repeat + 1):
            name = f"run-{i}"
            wall0, t0 = time.time(), time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-m", "jobs", "run", "tiny_cpu", "--run-name", name, *layout],
                                    cwd=project, env=inside, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            first = _first_step(project / "runs" / name / "metrics.jsonl", t0)
            proc.wait(timeout=300)
            events = _event_times(project / "runs" / name)
            rows.append(("slipway run, first" if i == 0 else "slipway run, again", float("nan"),
                         events.get("start", wall0) - wall0, events.get("preflight", float("nan")) - wall0, first))
    finally:
        subprocess.run(["scancel", job], env=env)
    _print_rows(rows)


def _print_rows(rows: list[tuple], headers: tuple[str, ...] = ("command returns s", "script starts s",
                                                                "preflight done s", "first step s")) -> None:
    """The median of each column per launch kind (seconds from the command, '-' where not measured)."""
    print(f"{'launch':40s} " + " ".join(f"{h:>17s}" for h in headers))
    for what in dict.fromkeys(r[0] for r in rows):
        group = [r for r in rows if r[0] == what]
        med = [statistics.median(r[k] for r in group) for k in range(1, len(headers) + 1)]
        print(f"{what:40s} " + " ".join(f"{'-' if m != m else f'{m:.2f}':>17s}" for m in med) + f"  (n={len(group)})")


def pyxis_loop(plugin: str, repeat: int) -> None:
    """Real pyxis (see the module's doc): each row from `slipway submit` to the run's first
    training step, and from a SIGKILLed rank to the job's end."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_image import TEST_BASE, ensure_test_base, ensure_wheelhouse  # the image tests' small base

    ensure_test_base()
    wheels = ensure_wheelhouse()
    tmp = Path(tempfile.mkdtemp(prefix="slipway-bench-pyxis-"))
    runtime = tmp / "pyxis-runtime"
    (tmp / "plugstack.conf").write_text(f"required {plugin} runtime_path={runtime}\n")
    cluster = LocalSlurmCluster(ClusterSpec(
        state_dir=default_state_dir("bench-pyxis"), nodes=2, name="slpwb", node_prefix="slpwb-node",
        ctl_host="slpwb-ctl", subnet="10.213.5", ctld_port=6967, slurmd_port=6968, plugstack=tmp / "plugstack.conf",
        node_private=(str(runtime), "/run/enroot", "/root/.local/share/enroot", "/root/.cache/enroot")))
    project = tmp / "project"
    shutil.copytree(ROOT / "configs", project / "configs")
    for name in ("common", "trainer"):
        shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    image = ["container.runtime=pyxis", f"image.base_image={TEST_BASE}", "image.flash_attn=false",
             f"image.wheelhouse={wheels}", "image.isolation=chroot", f"image.output_dir={tmp / 'images'}",
             "image.squash_options=-comp lz4"]
    subprocess.run([sys.executable, "-m", "jobs", "image", "build", "tiny_cpu", *image],
                   cwd=ROOT, check=True, capture_output=True)
    env = {**os.environ, **cluster.env(), "SLIPWAY_PROJECT": str(project)}
    env.pop("SLIPWAY_RUNS", None)
    layout = ["--nodes", "2", "--dp", "2", "train.steps=3", *MODEL, *image]
    rows: list[tuple[str, float, float, float]] = []
    kills: list[tuple[str, float, float, float]] = []

    def submit(name: str, *extra: str) -> tuple[float, float, float, float]:
        wall0, t0 = time.time(), time.perf_counter()
        subprocess.run([sys.executable, "-m", "jobs", "submit", "tiny_cpu", "--parsable", "--run-name", name,
                        *layout, *extra], cwd=project, env=env, capture_output=True, text=True, check=True)
        returned = time.perf_counter() - t0
        first = _first_step(project / "runs" / name / "metrics.jsonl", t0, limit=600)
        events = _event_times(project / "runs" / name)
        return returned, events.get("start", wall0) - wall0, events.get("preflight", float("nan")) - wall0, first

    def job_over(name: str) -> None:
        while subprocess.run(["squeue", "-h", "-n", name], env=env, capture_output=True, text=True).stdout.strip():
            time.sleep(0.1)

    cluster.up()
    try:
        rows.append(("pyxis: first job of a build (unpacks)", *submit("p-0")))
        job_over("p-0")
        for i in range(repeat):
            with open(project / "trainer" / "model.py", "a") as f:
                f.write(f"# edit {i}\n")
            rows.append(("pyxis: code change -> submit (kept)", *submit(f"p-{i + 1}")))
            job_over(f"p-{i + 1}")
        for keep in ("3", "0"):
            for i in range(repeat):
                name = f"k{keep}-{i}"
                submit(name, "train.steps=100000", f"container.keep_builds={keep}")
                # A rank (torchrun starts its workers as `python -u -m trainer ...`), not its agent.
                rank = rf"^\S*python\S* (-u )?-m trainer --config {project}/runs/{name}/"
                ranks = subprocess.run(["pgrep", "-f", rank], capture_output=True, text=True).stdout.split()
                if not ranks:
                    raise SystemExit(f"no rank of {name} found to kill: see {project / 'runs' / name}")
                t0, wall0 = time.perf_counter(), time.time()
                os.kill(int(ranks[-1]), 9)
                job_over(name)
                gone = time.perf_counter() - t0
                from common.events import read_events

                end = next((e.when.timestamp() for e in read_events(project / "runs" / name)
                            if e.text.startswith("end exit") and e.when), float("nan"))
                what = "kill -> end, build's container kept" if keep != "0" else "kill -> end, own container removed"
                kills.append((what, end - wall0, gone))
    finally:
        cluster.down(check=False)
    _print_rows(rows)
    print()
    _print_rows(kills, headers=("end event s", "job gone s"))
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dev-loop", action="store_true", help="the dev loop's timings instead (see above)")
    parser.add_argument("--pyxis", metavar="PLUGIN", help="the pyxis timings, with this spank_pyxis.so (see above)")
    args = parser.parse_args()
    if args.pyxis:
        pyxis_loop(args.pyxis, args.repeat)
        return
    cluster = LocalSlurmCluster(ClusterSpec(state_dir=default_state_dir("bench"), nodes=2))
    project = Path(tempfile.mkdtemp(prefix="slipway-bench-e2e-"))
    shutil.copytree(ROOT / "configs", project / "configs")
    env = {**os.environ, **cluster.env(), "SLIPWAY_PROJECT": str(project)}
    env.pop("SLIPWAY_RUNS", None)
    cluster.up()
    if args.dev_loop:
        try:
            dev_loop(project, env, args.repeat)
        finally:
            cluster.down(check=False)
            shutil.rmtree(project, ignore_errors=True)
        return
    try:
        results: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
        for i in range(args.repeat):
            for nodes in (1, 2):
                results[nodes].append(one_run(project, f"bench-{nodes}n-{i}", nodes, args.steps, env))
    finally:
        cluster.down(check=False)
        shutil.rmtree(project, ignore_errors=True)
    print(f"{'nodes x procs':14s} {'submit -> step 1 s (median)':>28s} {'tokens/s per process':>21s}"
          f"  (n={args.repeat}, {args.steps} steps)")
    tps = {}
    for nodes, rows in results.items():
        tps[nodes] = statistics.median(r[1] for r in rows)
        print(f"{nodes} x 1{'':10s} {statistics.median(r[0] for r in rows):28.2f} {tps[nodes]:21,.0f}")
    print(f"weak-scaling efficiency 1 -> 2 nodes: {100 * tps[2] / tps[1]:.0f}%")


if __name__ == "__main__":
    main()
