"""What a run reports: the console line, run_dir/metrics.jsonl, Weights & Biases, and torch
profiler traces. Only rank 0 writes metrics; every rank may write a profiler trace.

metrics.jsonl is an append-only history of JSON objects with a "kind": "restart" (training starts or
resumes at "step": later records for steps after it supersede what an earlier attempt logged for
them, as `common.metrics_log.latest_by_step` reads it), "train", "eval", and "nonfinite" (a skipped
step). Non-finite numbers are written as null (JSON has no NaN).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch
from rich.console import Console

from common.schema import to_dict
from trainer.config import LoggingSection, TrainerConfig
from common.metrics_log import format_duration

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s by CUDA device name; the first matching entry wins.
# MFU is reported against these even for fp32 runs (torchtitan's convention).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
)


def peak_flops(device: torch.device) -> Optional[float]:
    """None on CPU or on an unknown GPU: MFU is then null."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: the allocator's peak; CPU: the process's maximum resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss: KiB on Linux


def setup_logging(level: str, rank: int) -> None:
    """`trainer` loggers: rank 0 at `level`, others warnings only; the root logger is left alone (tests, embedders)."""
    logger = logging.getLogger("trainer")
    logger.setLevel(getattr(logging, level.upper()) if rank == 0 else logging.WARNING)
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler(sys.stderr))
    for handler in logger.handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))


class MetricsLogger:
    def __init__(self, cfg: TrainerConfig, run_dir: Path, rank: int, world_size: int, device: torch.device,
                 flops_per_token: int):
        self.enabled = rank == 0
        self.world_size = world_size
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(device)
        self.total_steps = cfg.train.steps
        self._started: Optional[tuple[float, int]] = None  # (time, step) of this attempt's start: the ETA
        self._jsonl = open(run_dir / "metrics.jsonl", "a") if self.enabled else None
        self._console = Console(highlight=False, soft_wrap=True) if self.enabled else None
        self._wandb = _init_wandb(cfg, run_dir) if self.enabled and cfg.logging.wandb else None

    def log_restart(self, step: int, layout: dict[str, int]) -> None:
        """Training (re)starts after `step` (0: from scratch)."""
        self._started = (time.perf_counter(), step)
        if not self.enabled:
            return
        self._write({"kind": "restart", "step": step, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "world_size": self.world_size, **layout})

    def eta_s(self, step: int) -> Optional[float]:
        """Seconds to the last step at this attempt's wall-clock pace (evaluation and saving included: they recur)."""
        if self._started is None or step <= self._started[1]:
            return None
        started_at, first = self._started
        return (time.perf_counter() - started_at) / (step - first) * (self.total_steps - step)

    def log_train(self, step: int, loss: float, lr: float, grad_norm: float, tokens: int, elapsed_s: float,
                  steps: int, data_s: float, skipped_steps: int = 0, warmup_s: Optional[float] = None) -> None:
        """`tokens` processed by all ranks over the last `steps` steps, which took `elapsed_s`. With
        `warmup_s` (an attempt's first step) the throughput fields are null: they describe training."""
        if not self.enabled:
            return
        timed = warmup_s is None and elapsed_s > 0
        tps = tokens / elapsed_s if timed else None
        tps_device = tps / self.world_size if timed else None
        tflops = self.flops_per_token * tps_device / 1e12 if timed else None
        record = {
            "kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tps, "tokens_per_s_per_device": tps_device, "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak if timed and self.peak else None,
            "step_time_s": elapsed_s / steps if timed else None, "data_time_s": data_s / steps,
            "peak_memory_gib": peak_memory_gib(self.device),
            "skipped_steps": skipped_steps, "eta_s": self.eta_s(step),
        }
        if warmup_s is not None:
            record["warmup_s"] = warmup_s
        mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a"
        skipped = f" [red]skipped {skipped_steps}[/]" if skipped_steps else ""
        if timed:
            speed = (f"[cyan]{tps:,.0f} tok/s[/] ({tps_device:,.0f}/dev) {tflops:.2f} TFLOP/s mfu {mfu} "
                     f"step {record['step_time_s']:.3f}s data {record['data_time_s']:.3f}s")
        else:
            speed = f"warm-up {warmup_s or 0.0:.3f}s (first step: compiling, allocating; not in tokens/s)"
        self._console.print(f"[bold]step {step}/{self.total_steps}[/] [green]loss {loss:.4f}[/] lr {lr:.2e} "
                    f"gnorm {grad_norm:.3f} {speed} "
                    f"mem {record['peak_memory_gib']:.2f}GiB eta {format_duration(record['eta_s'])}{skipped}")
        self._write(record)

    def log_nonfinite(self, step: int, loss: float, grad_norm: float, in_a_row: int, skipped_steps: int) -> None:
        if self.enabled:
            self._write({"kind": "nonfinite", "step": step, "loss": loss, "grad_norm": grad_norm,
                         "in_a_row": in_a_row, "skipped_steps": skipped_steps})

    def log_eval(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        self._console.print(f"[bold]step {step}[/] [magenta]eval loss {loss:.4f}[/]")
        self._write({"kind": "eval", "step": step, "eval_loss": loss})

    def _write(self, record: dict[str, Any]) -> None:
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._wandb is not None and record["kind"] in ("train", "eval"):
            self._wandb.log({k: v for k, v in record.items() if k not in ("kind", "step") and v is not None},
                            step=record["step"])

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()


def _init_wandb(cfg: TrainerConfig, run_dir: Path):
    try:
        import wandb
    except ImportError:
        log.warning("logging.wandb is true but wandb is not installed: not logging to Weights & Biases")
        return None
    # Without an API key, log offline (sync later with `wandb sync`); the key is never written down.
    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return wandb.init(project=cfg.run.project, name=cfg.run.name or run_dir.name, dir=str(run_dir),
                      config=to_dict(cfg), mode=mode)


class StepProfiler:
    """torch.profiler over logging.profiler_steps, a Chrome trace per rank in run_dir/profiler/."""

    def __init__(self, cfg: LoggingSection, run_dir: Path, rank: int):
        self.enabled = cfg.profiler
        self.first, self.last = cfg.profiler_steps
        self.out_dir = run_dir / "profiler"
        self.rank = rank
        self._prof: Optional[torch.profiler.profile] = None

    def begin(self, step: int) -> None:
        if self.enabled and step == self.first and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.__enter__()

    def end(self, step: int) -> None:
        if self._prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        if self._prof is None:
            return
        self._prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"steps{self.first}-{self.last}_rank{self.rank}.json"
        self._prof.export_chrome_trace(str(path))
        log.info("profiler trace written to %s", path)
        self._prof = None
        self.enabled = False
