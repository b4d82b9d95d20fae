"""A local run's memory: common/layouts.py's arithmetic (`process_memory`, what `slipway local`
checks before it starts any process) against the peak a rank reaches, side by side.

Each case is `slipway local tiny_cpu` with the overrides below, trained for a few steps in a
project of its own; rank 0's peak RSS is the `mem` of its last logged step (metrics.jsonl's
peak_memory_gib, the process's ru_maxrss).

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


def measure(overrides: list[str]) -> tuple[float, float]:
    """(estimated GB a process, rank 0's peak RSS GB) for `slipway local tiny_cpu OVERRIDES`."""
    from jobs.config import load_config
    from jobs.interactive import local_view
    from common.layouts import process_memory

    cfg, _ = local_view(load_config(ROOT / "configs" / "tiny_cpu.yaml", overrides), rename=False)
    project = Path(tempfile.mkdtemp(prefix="slipway-bench-memory-"))
    try:
        (project / "configs").mkdir()
        shutil.copy(ROOT / "configs" / "tiny_cpu.yaml", project / "configs")
        args = [*overrides, "train.steps=4", "logging.interval=1", "train.eval_interval=0", "checkpoint.interval=1000"]
        subprocess.run([sys.executable, "-m", "jobs", "local", "tiny_cpu", *args], cwd=project, check=True,
                       env={**os.environ, "SLIPWAY_PROJECT": str(project), "PYTHONPATH": str(ROOT)},
                       stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (project / "runs" / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
        peak = max(r["peak_memory_gib"] for r in records if r.get("kind") == "train") * 2**30
    finally:
        shutil.rmtree(project, ignore_errors=True)
    return process_memory(cfg) / 1e9, peak / 1e9


def main() -> None:
    print("| case | estimated GB a process | rank 0's peak RSS GB | estimate / peak |")
    print("|---|---|---|---|")
    for name, overrides in CASES.items():
        estimate, peak = measure(overrides)
        print(f"| {name} | {estimate:.2f} | {peak:.2f} | {estimate / peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
