"""Which layout to train each model preset with, and advice when a config strays from it.

Imports no torch: `slipway doctor` (the host side) calls `layout_advice(cfg)` with the
full config tree, and the trainer can call it with its own.

The defaults are for nodes of 4 GPUs (4 x H100 80 GB, or GH200 96 GB), bf16, FSDP2
across every GPU of the job. They are sized by arithmetic, not measured: fp32 master
weights and AdamW moments (16 bytes a parameter) sharded over the dp ranks; bf16
activations of about (12 x hidden + 4 x intermediate) x 2 bytes per token per block;
the logits, their fp32 copy and gradient at 10 bytes per token per vocabulary entry;
with room left for the allocator. torchtitan's published Llama 3 8B recipe (FSDP only
on 8 H100, selective activation checkpointing) is the anchor for `large`. Run
`bench/trainer.py` on your GPUs to check a preset's micro batch (BENCHMARKS.md).

Why tensor parallel stays off for all four: tp splits every matmul and adds two
all-reduces per block in the forward and two in the backward; below ~8B parameters the
split matmuls are too small to keep a GPU busy and the all-reduces sit on the critical
path, while FSDP's all-gathers and reduce-scatters overlap with compute. tp=4 on the
109M `tiny` preset is slower than dp=8 on the same 8 GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

GPUS_PER_NODE = 4


@dataclass(frozen=True)
class LayoutDefault:
    tp: int
    micro_batch_size: int
    seq_len: int
    activation_checkpointing: str  # train.activation_checkpointing
    note: str


LAYOUT_DEFAULTS: dict[str, LayoutDefault] = {
    # 109M: ~5 GB of activations and ~8 GB of logits at 32 x 512; tp would split 768-wide matmuls.
    "tiny": LayoutDefault(tp=1, micro_batch_size=32, seq_len=512, activation_checkpointing="none",
                          note="FSDP over every GPU; even one GPU has memory to spare"),
    # ~335M: ~18 GB of activations and ~8 GB of logits at 8 x 2048.
    "small": LayoutDefault(tp=1, micro_batch_size=8, seq_len=2048, activation_checkpointing="none",
                           note="FSDP over every GPU"),
    # ~1.1B (TinyLlama's shape): ~17 GB of activations at 4 x 2048, 2.2 GB of state a GPU over 8.
    "base": LayoutDefault(tp=1, micro_batch_size=4, seq_len=2048, activation_checkpointing="none",
                          note="FSDP over every GPU; micro batch 8 fits by the arithmetic (~42 GB)"),
    # ~6.7B (Llama 2 7B's shape): 13 GB of state a GPU over 8, ~49 GB of activations at 2 x 4096
    # without checkpointing, about half with the per-op selective policy.
    "large": LayoutDefault(tp=1, micro_batch_size=2, seq_len=4096, activation_checkpointing="selective",
                           note="FSDP over 2 or more nodes; selective_ac op"),
}


def layout_advice(cfg: Any) -> Optional[str]:
    """One line of advice when `cfg` (a TrainerConfig or the host's full tree) trains a preset
    model with more tensor or pipeline parallelism than its default; None otherwise."""
    model, parallel, train = cfg.model, cfg.parallel, cfg.train
    default = LAYOUT_DEFAULTS.get(model.size)
    if default is None or parallel.tp * parallel.pp <= default.tp:
        return None
    gpus = parallel.world_size
    dp = gpus // default.tp
    sequences = train.micro_batch_size * train.grad_accum_steps * parallel.dp  # the global batch
    split, costs = [], []
    if parallel.tp > default.tp:
        split.append(f"tp({parallel.tp})")
        costs.append("tensor parallel puts two all-reduces a block each way on the critical path and leaves "
                     "matmuls too small to fill a GPU")
    if parallel.pp > 1:
        split.append(f"pp({parallel.pp})")
        costs.append("a pipeline idles its stages in the bubbles")
    advice = (f"parallel: {' x '.join(split)} splits the {model.size} preset ({model.num_params() / 1e6:,.0f}M "
              f"parameters) across GPUs, which costs more than it gains below ~8B parameters ({'; '.join(costs)}). "
              f"Train it data parallel: parallel.dp={dp} parallel.tp={default.tp} parallel.pp=1 (FSDP)")
    if sequences % dp == 0:
        per_rank = sequences // dp
        micro = max(d for d in range(1, min(per_rank, default.micro_batch_size) + 1) if per_rank % d == 0)
        accum = per_rank // micro
        advice += (f" with train.micro_batch_size={micro}" + (f" train.grad_accum_steps={accum}" if accum > 1 else "")
                   + f", the same global batch of {sequences} sequences")
    return advice + (f". The {model.size} default on {GPUS_PER_NODE}-GPU nodes: tp {default.tp}, micro batch "
                     f"{default.micro_batch_size} at seq_len {default.seq_len}, activation_checkpointing "
                     f"{default.activation_checkpointing} ({default.note}); see trainer/layouts.py")
