"""Tokenization throughput and cache cost of the trainer's data pipeline.

For the builtin corpus with the builtin tokenizer (and gpt2's, when a copy is
already in the Hugging Face cache; nothing is downloaded): the cold
`build_data` (tokenize into an empty cache) at 1 thread and at every core,
the warm one (cache hit), and `next_batch()` for a 64 x 512 micro batch.
Each case runs in a fresh process, because the tokenizers thread pool is
sized once per process. Run with `.venv/bin/python bench/data.py [--repeat N]`.
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


def run_case(tokenizer: str, repeat: int) -> dict:
    """In this process: cold build, `repeat` warm builds, sampler speed. Returns the figures."""
    sys.path.insert(0, str(ROOT))
    from trainer.config import DataSection, ModelSection, TrainerConfig, TrainSection
    from trainer.data import build_data

    cache = Path(tempfile.mkdtemp(prefix="slipway-bench-data-"))
    try:
        cfg = TrainerConfig(data=DataSection(dataset="builtin", tokenizer=tokenizer, seq_len=512,
                                             cache_dir=str(cache)),
                            train=TrainSection(micro_batch_size=64), model=ModelSection(size="tiny"))
        start = time.perf_counter()
        train, _, _ = build_data(cfg, cache, 0, 1)
        cold = time.perf_counter() - start
        warm = []
        for _ in range(repeat):
            start = time.perf_counter()
            build_data(cfg, cache, 0, 1)
            warm.append(time.perf_counter() - start)
        (index_file,) = cache.glob("*.json")
        index = json.loads(index_file.read_text())
        start, batches = time.perf_counter(), 0
        while time.perf_counter() - start < 1.0:
            train.next_batch()
            batches += 1
        per_batch = (time.perf_counter() - start) / batches
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    text_bytes = index["n_chars"]  # the corpus is ASCII but for a handful of characters
    return {"cold_s": cold, "warm_s": statistics.median(warm), "n_tokens": index["n_tokens"],
            "mb": text_bytes / 1e6, "tokenize_s": index["seconds"], "batch_ms": per_batch * 1e3}


def gpt2_offline() -> str | None:
    """Why gpt2 is skipped, or None when its tokenizer.json is in the local HF cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return "huggingface_hub is not installed"
    path = try_to_load_from_cache("gpt2", "tokenizer.json")
    return None if isinstance(path, str) else "gpt2's tokenizer.json is not in the local Hugging Face cache (HF_HOME)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="warm builds per case (median reported)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.repeat)))
        return
    cores = os.cpu_count() or 1
    cases = [("builtin", 1), ("builtin", cores)]
    reason = gpt2_offline()
    if reason is None:
        cases += [("gpt2", 1), ("gpt2", cores)]
    print(f"{'tokenizer':10s} {'threads':>7s} {'text MB':>8s} {'tokens':>10s} {'cold s':>7s} {'MB/s':>6s} "
          f"{'Mtok/s':>7s} {'warm ms':>8s} {'batch ms':>9s}")
    for tokenizer, threads in cases:
        env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "RANK": "0"}
        out = subprocess.run([sys.executable, __file__, "--case", tokenizer, "--repeat", str(args.repeat)],
                             env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{tokenizer:10s} {threads:7d} {r['mb']:8.2f} {r['n_tokens']:10,d} {r['cold_s']:7.2f} "
              f"{r['mb'] / r['tokenize_s']:6.2f} {r['n_tokens'] / r['tokenize_s'] / 1e6:7.2f} "
              f"{r['warm_s'] * 1e3:8.2f} {r['batch_ms']:9.2f}")
    if reason:
        print(f"gpt2 skipped: {reason}")
    print("cold = build_data into an empty cache (read + tokenize + write); MB/s and Mtok/s = the tokenize pass; "
          "warm = build_data on a cache hit; batch = next_batch() of 64 x 512")


if __name__ == "__main__":
    main()
