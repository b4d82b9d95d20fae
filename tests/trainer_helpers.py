"""Shared helpers for the trainer tests: a tiny config, a deterministic
synthetic data source (no files, no tokenizer), and a script mode that runs
several configs one after another inside one torchrun world:

    torchrun --standalone --nproc-per-node N tests/trainer_helpers.py CONFIG...

(starting torch processes is what costs time on a small machine, so one launch
serves every layout of the same world size).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import yaml

if __package__ in (None, "") and not os.environ.get("SLIPWAY_CODE"):
    # Run as a script by torchrun: make `trainer` importable (a launch's code snapshot is already).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import TrainerConfig

TINY_MODEL = dict(size="custom", hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                  vocab_size=256, max_position_embeddings=64, tie_embeddings=False, init_std=0.02)


def tiny_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """A config dict for the tiny model, a global batch of 4 micro batches of 2 x 32 tokens, 8 steps."""
    cfg: dict[str, Any] = {
        "run": {"name": "test", "seed": 7},
        "model": dict(TINY_MODEL),
        "parallel": {"dp": 1, "tp": 1, "pp": 1},
        "data": {"seq_len": 32},
        "train": {"steps": 8, "micro_batch_size": 2, "grad_accum_steps": 4, "lr": 3e-3, "min_lr": 3e-4,
                  "warmup_steps": 2, "dtype": "float32", "eval_interval": 0, "eval_batches": 2},
        "checkpoint": {"interval": 1000},
        "logging": {"interval": 1},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def write_run(root: Path, name: str, cfg: dict[str, Any]) -> Path:
    """runs/NAME/config.yaml under `root`; returns the config path."""
    run_dir = root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


ROOT = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's or Slurm's variables, the project importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def torchrun(nproc: int, configs: list[Path], timeout: int = 300, env: Optional[dict[str, str]] = None,
             expect: int = 0) -> subprocess.CompletedProcess:
    """Train `configs` one after another in one `torchrun --nproc-per-node nproc` world (this file's main)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), *map(str, configs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=ROOT)
    assert (proc.returncode == 0) == (expect == 0), (f"torchrun x{nproc} exited {proc.returncode}:\n"
                                                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


# A test hook: SLIPWAY_TEST_POISON="STEP:RANK" makes the training loss NaN on that
# optimizer step on that global rank (the workers of `torchrun` above read it).
POISON_ENV = "SLIPWAY_TEST_POISON"


def poison_loss(step: int, rank: int, accum: int) -> Callable[[], None]:
    """Wrap trainer.runners.cross_entropy (looked up at call time by both runners) so that
    the training losses of optimizer step `step` on global rank `rank` are NaN, counting
    steps from this call; returns the function that puts the original back."""
    import trainer.runners as runners

    original = runners.cross_entropy
    calls = [0]

    def poisoned(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        loss = original(logits_BTV, targets_BT)
        if torch.is_grad_enabled():  # training, not evaluation
            calls[0] += 1
            if (calls[0] - 1) // accum + 1 == step and int(os.environ.get("RANK", "0")) == rank:
                loss = loss * float("nan")
        return loss

    runners.cross_entropy = poisoned

    def restore() -> None:
        runners.cross_entropy = original

    return restore


class SyntheticSampler:
    """Micro batch k of dp rank r is global micro batch k * dp_size + r, so any
    dp x grad_accum split of the same global batch sees the same rows. Rows are
    arithmetic sequences mod vocab (learnable, so losses move)."""

    def __init__(self, seed: int, vocab_size: int, micro_batch_size: int, seq_len: int, dp_rank: int, dp_size: int):
        self.seed, self.vocab_size = seed, vocab_size
        self.shape = (micro_batch_size, seq_len)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = 0
        # Tests that must catch a run mid-way slow it down (seconds per micro batch).
        self.delay_s = float(os.environ.get("SLIPWAY_TEST_BATCH_DELAY", "0"))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        index = self.consumed * self.dp_size + self.dp_rank
        self.consumed += 1
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        rows, seq_len = self.shape
        start = torch.randint(0, self.vocab_size, (rows, 1), generator=gen)
        stride = torch.randint(1, 5, (rows, 1), generator=gen)
        tokens = (start + stride * torch.arange(seq_len + 1)) % self.vocab_size
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["consumed"])


def synthetic_data(cfg: TrainerConfig, run_dir: Path, dp_rank: int, dp_size: int):
    """A DataBuilder (see trainer.train): the train and validation samplers."""
    make = lambda seed: SyntheticSampler(seed, cfg.model.vocab_size, cfg.train.micro_batch_size,  # noqa: E731
                                         cfg.data.seq_len, dp_rank, dp_size)
    return make(1234), make(999), cfg.model.vocab_size


def run_configs(paths: list[str]) -> int:
    """Train each config in turn in this process (one shared process group)."""
    import torch.distributed as dist

    from trainer.train import main

    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("gloo")
    poison = tuple(map(int, os.environ[POISON_ENV].split(":"))) if os.environ.get(POISON_ENV) else None
    worst = 0
    for path in paths:
        restore = poison_loss(*poison, accum=_accum(path)) if poison else (lambda: None)
        try:
            worst = max(worst, main(["--config", path], data=synthetic_data))
        finally:
            restore()
    if dist.is_initialized():
        dist.destroy_process_group()
    return worst


def _accum(config_path: str) -> int:
    from trainer.config import load_trainer_config

    return load_trainer_config(config_path).train.grad_accum_steps


def main(argv: Optional[list[str]] = None) -> int:
    return run_configs(list(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
