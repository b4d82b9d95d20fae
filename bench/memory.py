"""A local run's memory and time: common/layouts.py's arithmetic (`process_memory`) and the step
time `slipway local` expects (jobs/local_checks.py `measure`: trainer/probe.py's rates here), what
it checks before it starts any process, against the peak a rank reaches and the step time it trains
at, side by side.

Each case is `slipway local tiny_cpu` with the overrides below, trained for a few steps in a
project of its own; rank 0's peak RSS is the `mem` of its last logged step (metrics.jsonl's
peak_memory_gib, the process's ru_maxrss), its step time the median of the steps after the first.

    .venv/bin/python bench/memory.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = {
    "tiny_cpu (1M parameters, micro batch 8 x 128)": [],
    "24M parameters, micro batch 16 x 256": [
        "model.hidden_size=512", "model.intermediate_size=1376", "model.num_layers=8", "model.num_heads=8",
        "model.num_kv_heads=2", "train.micro_batch_size=16", "data.seq_len=256", "model.max_position_embeddings=256"],
    "tiny_cpu at micro batch 64 x 128": ["train.micro_batch_size=64"],
    "tiny_cpu, tp 2 (dp 1), micro batch 64": ["parallel.dp=1", "parallel.tp=2", "train.micro_batch_size=64"],
}


def measure(overrides: list[str]) -> tuple[float, float, float, float]:
    """(estimated GB a process, rank 0's peak RSS GB, estimated and measured seconds a step) for
    `slipway local tiny_cpu OVERRIDES`."""
    import statistics

    from jobs.config import load_config
    from jobs.local_checks import local_view, measure as speed_here
    from common.layouts import process_memory

    cfg, _ = local_view(load_config(ROOT / "configs" / "tiny_cpu.yaml", overrides), rename=False)
    speed, why = speed_here(cfg)
    if speed is None:
        raise SystemExit(why)
    expected = speed.step_s(cfg)
    project = Path(tempfile.mkdtemp(prefix="slipway-bench-memory-"))
    try:
        (project / "configs").mkdir()
        shutil.copy(ROOT / "configs" / "tiny_cpu.yaml", project / "configs")
        args = [*overrides, "train.steps=8", "logging.interval=1", "train.eval_interval=0", "checkpoint.interval=1000"]
        subprocess.run([sys.executable, "-m", "jobs", "local", "tiny_cpu", *args], cwd=project, check=True,
                       env={**os.environ, "SLIPWAY_PROJECT": str(project), "PYTHONPATH": str(ROOT)},
                       stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (project / "runs" / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if r.get("kind") == "train"]
        peak = max(r["peak_memory_gib"] for r in steps) * 2**30
        step_s = statistics.median(r["step_time_s"] for r in steps[1:] if r.get("step_time_s"))
    finally:
        shutil.rmtree(project, ignore_errors=True)
    return process_memory(cfg) / 1e9, peak / 1e9, expected, step_s


def main() -> None:
    print("| case | estimated GB a process | rank 0's peak RSS GB | estimate / peak | estimated s a step "
          "| measured s a step | estimate / measured |")
    print("|---|---|---|---|---|---|---|")
    for name, overrides in CASES.items():
        estimate, peak, expected, step_s = measure(overrides)
        print(f"| {name} | {estimate:.2f} | {peak:.2f} | {estimate / peak:.2f} | {expected:.3f} | {step_s:.3f} "
              f"| {expected / step_s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
