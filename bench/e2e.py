"""End to end on the local Slurm cluster of `slipway cluster`: the time from
`slipway submit` to the first training step (the first metrics.jsonl line), and
weak scaling from 1 to 2 nodes (the same per-process batch; tokens/s per process
at 2 nodes divided by tokens/s per process at 1 node).

One process per node, so the 2-node run uses as many cores as there are
processes (the local "nodes" share this machine's cores).

    .venv/bin/python bench/e2e.py [--steps 30] [--repeat 2]     # needs root, slurm-wlm, munge
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
from jobs.cluster import ClusterSpec, LocalSlurmCluster, default_state_dir  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    cluster = LocalSlurmCluster(ClusterSpec(state_dir=default_state_dir("bench"), nodes=2))
    project = Path(tempfile.mkdtemp(prefix="slipway-bench-e2e-"))
    shutil.copytree(ROOT / "configs", project / "configs")
    env = {**os.environ, **cluster.env(), "SLIPWAY_PROJECT": str(project)}
    env.pop("SLIPWAY_RUNS", None)
    cluster.up()
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
