"""Checkpoint saves: how long a training step blocks on one, synchronous against asynchronous.

One run prints, side by side, for each `checkpoint.async_save` setting: the time the
`Checkpointer.save` call holds the training loop (what a save costs the step), the step
after it (an asynchronous save's writing competes with it for the CPU and the disk), the
time until the checkpoint is complete and visible (the next save or `close()` makes an
asynchronous one visible), against a step without a save. The model is the trainer's
Llama (`--size`, the `tiny` preset by default: 109M parameters, a checkpoint of about
1.3 GB with AdamW's moments) trained in one process, as `python -m trainer` runs it;
each case runs in a fresh process, the cases interleaved over `--repeat` rounds.

    .venv/bin/python bench/checkpoint.py                  # tiny, 3 saves per case, 2 rounds
    .venv/bin/python bench/checkpoint.py --size small --dir /scratch/ckpt-bench
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
sys.path.insert(0, str(ROOT))  # the project's `trainer`, not bench/trainer.py beside this script
MODES = ("sync", "async")


def case(mode: str, size: str, saves: int, micro_batch: int, seq_len: int, where: Path) -> dict:
    """Train `saves` x 3 steps, saving after every third; time each part."""
    import torch

    from trainer.checkpoint import Checkpointer
    from trainer.config import CheckpointSection, ModelSection, TrainSection
    from trainer.model import Transformer
    from trainer.optim import build_optimizer
    from trainer.runners import cross_entropy
    from trainer.states import ModelState, OptimizerState, RNGState

    torch.manual_seed(0)
    cfg = ModelSection(size=size, max_position_embeddings=max(seq_len, 512))
    model = Transformer(cfg)
    optimizer = build_optimizer(model, TrainSection())
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1))

    def step() -> float:
        t0 = time.perf_counter()
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "rng": RNGState()}
    ckpt_dir = where / f"{mode}-{os.getpid()}"
    checkpointer = Checkpointer(ckpt_dir, CheckpointSection(keep_last=2), async_save=mode == "async")
    plain, blocked, after, visible = [], [], [], []
    step()  # warm-up: allocations, AdamW's state
    for n in range(saves):
        plain += [step(), step()]
        t0 = time.perf_counter()
        checkpointer.save(n + 1, states)
        blocked.append(time.perf_counter() - t0)
        after.append(step())
        if mode == "async":  # the time until it is complete: the wait the next save or close() does
            t1 = time.perf_counter()
            checkpointer.close()
            visible.append(blocked[-1] + after[-1] + time.perf_counter() - t1)
        else:
            visible.append(blocked[-1])
    checkpointer.close()
    nbytes = sum(f.stat().st_size for f in (ckpt_dir / f"step-{saves:06d}").iterdir())
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return {"mode": mode, "params": cfg.num_params(), "checkpoint_bytes": nbytes, "step_s": statistics.median(plain),
            "save_blocks_s": statistics.median(blocked), "step_after_save_s": statistics.median(after),
            "complete_s": statistics.median(visible)}


def run_case(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", json.dumps(spec)], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=["tiny", "small", "base", "large"])
    parser.add_argument("--saves", type=int, default=3, help="saves per case (the median is shown)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds, the cases interleaved")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = parser.parse_args()
    if args.case:
        spec = json.loads(args.case)
        print(json.dumps(case(spec["mode"], spec["size"], spec["saves"], spec["micro_batch"], spec["seq_len"],
                              Path(spec["where"]))))
        return
    where = args.dir or Path(tempfile.mkdtemp(prefix="slipway-ckpt-bench-"))
    where.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        for _ in range(args.repeat):
            for mode in MODES:
                results[mode].append(run_case({"mode": mode, "size": args.size, "saves": args.saves,
                                               "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                                               "where": str(where)}))
    finally:
        if args.dir is None:
            shutil.rmtree(where, ignore_errors=True)
    first = results[MODES[0]][0]
    print(f"model {args.size} ({first['params'] / 1e6:.0f}M parameters), checkpoint "
          f"{first['checkpoint_bytes'] / 2**30:.2f} GiB, micro batch {args.micro_batch} x {args.seq_len} tokens, "
          f"{args.saves} saves x {args.repeat} rounds; medians over the rounds, seconds")
    print("| save | step without a save | save blocks the step | step after the save | until complete |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        rows = results[mode]
        med = {key: statistics.median(r[key] for r in rows)
               for key in ("step_s", "save_blocks_s", "step_after_save_s", "complete_s")}
        print(f"| {mode} | {med['step_s']:.2f} | {med['save_blocks_s']:.2f} | {med['step_after_save_s']:.2f} | "
              f"{med['complete_s']:.2f} |")


if __name__ == "__main__":
    main()
