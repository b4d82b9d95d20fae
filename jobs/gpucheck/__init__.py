"""`slipway gpu-check`: does this GPU node train correctly, and fast? One command, on the node,
offline, with the node's own PyTorch, in at most ten minutes, written up in DIR/report.md and
DIR/report.json (docs/trainer.md, "checking a new cluster's GPU node").

Five parts, each with a time budget of its own (`--budget PART=SECONDS`, jobs/gpucheck/check.py):

- node: GPUs, driver, CUDA, torch, NCCL, flash-attn, torchtitan, the NUMA layout, and the
  environment slipway exports for the ranks (`python -m trainer.gpucheck node`);
- correctness: the trainer's bf16 losses on the device against its fp32 losses on the CPU
  (`python -m trainer`, the same data and seed, as tests/test_gpu.py); SDPA's flash backend and
  flash-attn against the math path (`python -m trainer.gpucheck attention`);
- training: `slipway local` (one process per GPU, FSDP2) with checkpoints, then the same run
  resumed from its middle checkpoint (the last one lost), whose losses must repeat the first
  attempt's; a dp x tp run of the same global batch where there are several GPUs; the hang
  watchdog on throughout;
- allreduce: NCCL's all-reduce bus bandwidth across the node's GPUs (torchrun);
- speed: tokens/s, TFLOP/s and MFU of the tiny preset at seq 512 in bf16, eager then compiled,
  ours beside a bare loop on the same model and torchtitan where it imports
  (`python -m trainer.speed`, bench/trainer.py's cases).

`--device cpu` runs the same on the CPU with a tiny model (two processes stand for two GPUs):
what needs no CUDA is proved there (the report, the budgets, the resume). The host side imports
no torch: what measures runs as `python -m trainer...` with this Python, whose torch is the
node's. What it needs besides travels as a directory of wheels (jobs/gpucheck/wheels.py).
"""

from jobs.gpucheck.check import BUDGETS
from jobs.gpucheck.parts import gpu_check

__all__ = ["BUDGETS", "gpu_check"]
