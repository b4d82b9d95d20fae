"""Training throughput, measured one way wherever it is measured: `slipway gpu-check` on a
user's node and bench/trainer.py here. One case per process (peak memory is per case):

    python -m trainer.speed ours|bare [--device cuda] [--preset tiny --seq-len 512 ...]

prints `RESULT {json}`: steady-state tokens/s (a whole and per device), the step time, peak
memory, the model's FLOPs per token (torchtitan's convention, the padded vocabulary included),
TFLOP/s per device and MFU (null on the CPU or an unknown GPU). The first `--warmup` steps are
left out, and so is each trainer's first logged window.

- ours: `trainer.train.train` with its defaults; under torchrun, dp = the world (FSDP2).
- bare: a plain loop on the same `trainer.model.Transformer`: the same batch, fused AdamW,
  clipping, dtype, compile and activation checkpointing; one host sync after the timed steps.

Every case runs the same attention kernel (`flash_only`); bench/titan.py adds torchtitan's trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional


def model_dict(case: Any) -> dict[str, Any]:
    """The `model:` section of `case` (a preset, with any dimension given overriding it), untied in
    every case: torchtitan's llama3 cannot tie its embeddings."""
    from trainer.config import MODEL_PRESETS

    base = dict(MODEL_PRESETS.get(case.preset, {}))
    overrides = dict(hidden_size=case.hidden, num_layers=case.layers, num_heads=case.heads,
                     num_kv_heads=case.kv_heads, vocab_size=case.vocab, intermediate_size=case.ffn)
    base.update({k: v for k, v in overrides.items() if v is not None})
    if base.get("intermediate_size") is None:
        base["intermediate_size"] = 2 * base["hidden_size"]  # the tiny preset's ratio
    if base.get("num_kv_heads") is None:
        base["num_kv_heads"] = base["num_heads"]
    base["max_position_embeddings"] = max(case.seq_len, base.get("max_position_embeddings") or 0)
    base.update(tie_embeddings=False, size="custom", init_std=0.02, attention=case.attention)
    return base


def trainer_config(case: Any, dp: int) -> dict[str, Any]:
    return {
        "run": {"name": "speed", "seed": 0},
        "model": model_dict(case),
        "parallel": {"dp": dp, "tp": 1, "pp": 1, "dp_mode": "fsdp", "zero_stage": 1},
        "data": {"dataset": "builtin", "tokenizer": "builtin", "seq_len": case.seq_len},
        "train": {"steps": case.steps, "micro_batch_size": case.micro_batch, "grad_accum_steps": 1,
                  "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 0, "decay": "constant", "dtype": case.dtype,
                  "compile": case.compile, "activation_checkpointing": case.ac, "eval_interval": 0},
        "checkpoint": {"interval": 10**9, "keep_last": 1},
        "logging": {"interval": case.log_interval},
    }


class RandomTokens:
    """A Sampler of uniformly random tokens (the model cannot tell, the timing does not care)."""

    def __init__(self, vocab: int, batch: int, seq_len: int, seed: int):
        import torch

        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.shape = vocab, (batch, seq_len + 1)
        self.consumed = 0

    def next_batch(self):
        import torch

        self.consumed += 1
        tokens = torch.randint(0, self.vocab, self.shape, generator=self.gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


def random_data(cfg, run_dir, dp_rank, dp_size):
    return (RandomTokens(cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.data.seq_len, 1 + dp_rank),
            None, cfg.model.vocab_size)


def steady(records: list[dict], warmup: int) -> dict[str, Any]:
    """Tokens/s etc. over the logged windows that start at or after step `warmup` (a record covers the
    steps since the one before it; an attempt's first, a warm-up, has no throughput)."""
    records = sorted(records, key=lambda r: r["step"])
    windows = [(r["step"] - prev["step"], r) for prev, r in zip(records, records[1:])
               if prev["step"] >= warmup and r["tokens_per_s"] is not None]
    if not windows:
        raise ValueError(f"no logged window starts at or after step {warmup}: raise --steps or lower --warmup")
    elapsed = sum(n * r["step_time_s"] for n, r in windows)
    tokens = sum(n * r["step_time_s"] * r["tokens_per_s"] for n, r in windows)
    steps = sum(n for n, _ in windows)
    return {"steps_timed": steps, "step_time_s": elapsed / steps, "tokens_per_s": tokens / elapsed,
            "peak_memory_gib": max(r["peak_memory_gib"] for r in records)}


def flash_only(case: Any) -> bool:
    """CUDA in 16 bits: SDPA's flash backend alone, the kernel torchtitan's SDPA row is given too (the
    default order may pick cuDNN or memory-efficient attention); a shape it cannot run fails loudly."""
    return case.device == "cuda" and case.dtype != "float32" and case.attention == "sdpa"


def _sdpa_flash_only(case: Any) -> None:
    import torch

    if flash_only(case):
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
        torch.backends.cuda.enable_flash_sdp(True)


def rates(case: Any, out: dict[str, Any], world: int = 1) -> dict[str, Any]:
    """`out` with the per-device rate, the FLOPs, TFLOP/s and MFU of this case's model on its device."""
    import torch

    from common.schema import from_dict
    from trainer.config import ModelSection
    from trainer.metrics import peak_flops
    from common.layouts import num_flops_per_token

    flops = num_flops_per_token(from_dict(ModelSection, model_dict(case)), case.seq_len)
    per_device = out["tokens_per_s"] / world
    cuda = case.device == "cuda"
    peak = peak_flops(torch.device(case.device)) if cuda else None
    reserved = out.get("peak_reserved_gib", torch.cuda.max_memory_reserved() / 2**30 if cuda else None)
    return {**out, "processes": world, "tokens_per_s_per_device": per_device, "flops_per_token": flops,
            "tflops_per_device": flops * per_device / 1e12, "mfu": flops * per_device / peak if peak else None,
            "peak_reserved_gib": reserved, "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)"}


def case_ours(case: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from common.errors import ConfigError
    from common.schema import from_dict
    from trainer.config import TrainerConfig
    from trainer.train import train

    world = int(os.environ.get("WORLD_SIZE", "1"))
    raw = trainer_config(case, dp=world)
    if case.hang_timeout is not None:  # 0: the hang watchdog (trainer/watchdog.py) off
        raw["train"]["hang_timeout"] = case.hang_timeout
    if case.cache_dir:
        raw["data"]["cache_dir"] = case.cache_dir
    cfg = from_dict(TrainerConfig, raw)
    _sdpa_flash_only(case)
    run_dir = Path(case.run_dir) if case.run_dir else Path(tempfile.mkdtemp(prefix="slipway-speed-"))
    if run_dir.is_dir() and any(run_dir.iterdir()):  # a run's own: it would resume it, mix its metrics, lose its saves
        raise ConfigError("--run-dir", f"{run_dir} is not empty: give a new directory for the case's run")
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        train(cfg, run_dir, data=None if case.data == "builtin" else random_data)
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if rank != 0:
            return {}
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return rates(case, steady([r for r in records if r.get("kind") == "train"], case.warmup), world)
    finally:  # the last step's checkpoint is no result (1.3 GB for the tiny preset): never left behind
        shutil.rmtree(run_dir / cfg.checkpoint.dir if case.run_dir else run_dir, ignore_errors=True)


def case_bare(case: Any) -> dict[str, Any]:
    """The least a training step can do on the same model (module docstring)."""
    import torch
    import torch.nn.functional as F

    from common.schema import from_dict
    from trainer.compute import apply_ac, compile_blocks
    from trainer.config import ModelSection
    from trainer.metrics import peak_memory_gib
    from trainer.model import Transformer, select_attention

    device = torch.device(case.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case.dtype]
    _sdpa_flash_only(case)
    mcfg = from_dict(ModelSection, model_dict(case))
    torch.manual_seed(0)
    model = Transformer(mcfg, select_attention(mcfg, device, dtype)).to(device)
    apply_ac(model, case.ac, "op")
    if case.compile:
        compile_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    data = RandomTokens(mcfg.vocab_size, case.micro_batch, case.seq_len, 1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses = []
    for step in range(case.steps):
        if step == case.warmup:  # the timed steps: no host sync until they are all done
            sync()
            t0 = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in data.next_batch())
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.stack(losses).tolist()  # the loop is done when its losses are known
    elapsed = time.perf_counter() - t0
    timed = case.steps - case.warmup
    tokens = case.micro_batch * case.seq_len * timed
    return rates(case, {"steps_timed": timed, "step_time_s": elapsed / timed, "tokens_per_s": tokens / elapsed,
                         "peak_memory_gib": peak_memory_gib(device)})


def main(argv: Optional[list[str]] = None, cases: Optional[dict[str, Any]] = None,
         prog: str = "python -m trainer.speed") -> int:
    """One case as a process; bench/titan.py runs its own case through here too."""
    from common.edge import Parser
    from common.errors import ConfigError

    cases = cases or {"ours": case_ours, "bare": case_bare}
    p = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("case", choices=tuple(cases))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--preset", default="tiny", help="tiny|small|base|large, or custom with the dimensions below")
    for flag in ("--hidden", "--layers", "--heads", "--kv-heads", "--vocab", "--ffn"):
        p.add_argument(flag, type=int)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="leading steps left out of the figures")
    p.add_argument("--log-interval", type=int, default=10, help="steps between logged (host-synced) steps")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--data", choices=("synthetic", "builtin"), default="synthetic",
                   help="ours: random tokens or the shipped corpus and tokenizer (what torchtitan reads)")
    p.add_argument("--attention", choices=("sdpa", "flash", "auto"), default="sdpa")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ac", choices=("none", "selective", "full"), default="none")
    p.add_argument("--hang-timeout", type=float, help="ours: train.hang_timeout (0: the hang watchdog off)")
    p.add_argument("--cache-dir", help="ours with --data builtin: the token cache")
    p.add_argument("--run-dir", help="ours: the run directory (needed under torchrun; default a temporary one)")
    case = p.parse_args(argv)
    try:
        result = cases[case.case](case)
    except (RuntimeError, ValueError) as exc:  # a case's failure, or no steady window: one line
        print(f"speed {case.case}: not run: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    if result:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
