"""Which layout to train each model preset with, and advice when a config strays from it. No torch:
`slipway doctor` calls `layout_advice` with the host's config tree, the trainer with its own. The
defaults, their memory arithmetic and why tensor parallel stays off: docs/trainer.md#layouts.
"""

from __future__ import annotations

import os
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
    reshard_after_forward: bool = False  # parallel.reshard_after_forward's auto


GPU_BUDGET_FRACTION = 0.85  # of a GPU's memory that the arithmetic below may plan for
# The allocator setting the estimate assumes, exported for every rank (the batch script, `slipway
# local`) unless launch.env or the environment sets either name: torch reads the first set.
ALLOC_CONF = "expandable_segments:True"
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


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
                           note="FSDP over one node or more, resharded after the forward; selective_ac op",
                           reshard_after_forward=True),
}


def gpu_memory_estimate(model: Any, micro_batch_size: int, seq_len: int, dp: int, reshard_after_forward: bool,
                        activation_checkpointing: str) -> dict[str, float]:
    """Bytes by part one GPU holds at an FSDP2 bf16 step's peak, by arithmetic (docs/trainer.md#layouts)."""
    params = model.num_params()
    tokens = micro_batch_size * seq_len
    per_block = params / model.num_layers  # gathered bf16 weights: every block's, or two at a time
    return {"state": 16 * params / dp,
            "gathered": 2 * (2 * per_block if reshard_after_forward else params),
            "activations": activation_bytes(model, tokens, 2, 1, activation_checkpointing),
            "logits": 10 * tokens * model.padded_vocab_size}


def activation_bytes(model: Any, tokens: int, width: int, tp: int, activation_checkpointing: str) -> float:
    """Activations of `tokens` through every block, `width` bytes a value: about (12 x hidden + 4 x
    intermediate) a token a block, half with selective checkpointing; with full, the block inputs and one block's."""
    per_token_block = (12 * model.hidden_size + 4 * model.intermediate_size) * width / tp
    if activation_checkpointing == "full":
        return tokens * (model.num_layers * model.hidden_size * width + per_token_block)
    return tokens * per_token_block * model.num_layers * (0.5 if activation_checkpointing == "selective" else 1.0)


def resolve_reshard(cfg: Any) -> tuple[bool, str]:
    """parallel.reshard_after_forward for `cfg`, and why (for the trainer's log line)."""
    setting = cfg.parallel.reshard_after_forward
    if setting != "auto":
        return bool(setting), "parallel.reshard_after_forward"
    if cfg.parallel.zero_stage == 3:
        return True, "zero_stage 3"
    if getattr(LAYOUT_DEFAULTS.get(cfg.model.size), "reshard_after_forward", False):
        return True, f"the {cfg.model.size} preset's default, common/layouts.py"
    return False, f"zero_stage {cfg.parallel.zero_stage}"


def layout_advice(cfg: Any) -> Optional[str]:
    """One line of advice where `cfg` trains a preset model with more tp or pp than its default, else None."""
    model, parallel, train = cfg.model, cfg.parallel, cfg.train
    default = LAYOUT_DEFAULTS.get(model.size)
    if default is None or parallel.tp * parallel.pp <= default.tp:
        return None
    dp = parallel.world_size // default.tp
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
                     f"{default.activation_checkpointing} ({default.note}); see common/layouts.py")


def memory_report(cfg: Any, dp: int, reshard_after_forward: bool,
                  gpu_bytes: Optional[int]) -> tuple[str, Optional[str]]:
    """The trainer's log line of `gpu_memory_estimate`, and a warning where it passes GPU_BUDGET_FRACTION."""
    train = cfg.train
    parts = gpu_memory_estimate(cfg.model, train.micro_batch_size, cfg.data.seq_len, dp, reshard_after_forward,
                                train.activation_checkpointing)
    total = sum(parts.values())
    line = (f"memory by common/layouts.py's arithmetic: ~{total / 1e9:.1f} GB a GPU (weights and AdamW state "
            f"{parts['state'] / 1e9:.1f}, gathered bf16 weights {parts['gathered'] / 1e9:.1f}, activations "
            f"{parts['activations'] / 1e9:.1f}, logits {parts['logits'] / 1e9:.1f} GB)")
    if gpu_bytes is not None:
        conf = next((f"{name}={os.environ[name]}" for name in ALLOC_CONF_NAMES if os.environ.get(name)), None)
        line += (f", with {conf}" if conf and "expandable_segments:true" in conf.lower() else
                 f"; the allocator's segments are fixed ({conf or f'no {ALLOC_CONF_NAMES[0]}'}), so FSDP2's "
                 f"varying all-gathers may fragment it beyond the {1 - GPU_BUDGET_FRACTION:.0%} this leaves: "
                 f"{ALLOC_CONF_NAMES[0]}={ALLOC_CONF} is the default")
    if gpu_bytes is None or total <= GPU_BUDGET_FRACTION * gpu_bytes:
        return line, None
    fixes = []
    if train.activation_checkpointing != "full":
        fixes.append("train.activation_checkpointing: " + ("full" if train.activation_checkpointing == "selective"
                                                            else "selective"))
    if not reshard_after_forward:
        fixes.append("parallel.reshard_after_forward: true")
    fixes.append(f"a train.micro_batch_size below {train.micro_batch_size} (with more grad_accum_steps)")
    return line, (f"the estimate, ~{total / 1e9:.0f} GB a GPU, passes {GPU_BUDGET_FRACTION:.0%} of this GPU's "
                  f"{gpu_bytes / 1e9:.0f} GB: expect out-of-memory; set {' or '.join(fixes)}")


# What one CPU rank holds before any model (tiny_cpu's ranks peak at 0.5 GB with 1M parameters).
# bench/memory.py sets the arithmetic below beside measured peaks: at or up to 10% above them.
PROCESS_BASE_BYTES = 0.6e9


def process_memory(cfg: Any, micro_batch_size: Optional[int] = None, seq_len: Optional[int] = None) -> float:
    """Bytes one process of `cfg`'s layout holds at its peak on CPUs, by arithmetic, in the run's dtype
    (float32 unless set): AdamW state is 16 bytes a parameter, split by tp and pp, sharded by FSDP."""
    model, parallel, train = cfg.model, cfg.parallel, cfg.train
    micro = train.micro_batch_size if micro_batch_size is None else micro_batch_size
    tokens = micro * (cfg.data.seq_len if seq_len is None else seq_len)
    width = 2 if train.dtype == "bfloat16" else 4
    split = parallel.tp * parallel.pp
    params = model.num_params() / split
    fsdp = parallel.dp_mode == "fsdp" and parallel.dp > 1
    state = 16 * params / (parallel.dp if fsdp else 1)
    gathered = width * params if fsdp else 0.0
    activations = activation_bytes(model, tokens, width, parallel.tp, train.activation_checkpointing)
    logits = 10 * tokens * model.padded_vocab_size / (parallel.tp if parallel.loss_parallel else 1)
    return PROCESS_BASE_BYTES + state + gathered + activations + logits


def fitting_batch(cfg: Any, budget: float) -> Optional[tuple[int, int, int]]:
    """(micro batch, gradient accumulation, seq_len) within `budget` bytes a process, the layout and
    global batch kept: else micro batch 1 at the longest power-of-two fraction of seq_len; else None."""
    train, seq = cfg.train, cfg.data.seq_len
    per_rank = train.micro_batch_size * train.grad_accum_steps
    for micro in range(train.micro_batch_size, 0, -1):
        if per_rank % micro == 0 and process_memory(cfg, micro) <= budget:
            return micro, per_rank // micro, seq
    while seq > 16:
        seq //= 2
        if process_memory(cfg, 1, seq) <= budget:
            return 1, per_rank, seq
    return None


def smaller_batch_hint(cfg: Any) -> str:
    """What to change after a rank ran out of memory in a job: the micro batch halved or less, the
    global batch unchanged; at micro batch 1, activation checkpointing or a shorter sequence."""
    train = cfg.train
    per_rank = train.micro_batch_size * train.grad_accum_steps
    micro = max((d for d in range(1, train.micro_batch_size // 2 + 1) if per_rank % d == 0), default=0)
    if not micro:
        return "at micro batch 1: set train.activation_checkpointing: full, or a shorter data.seq_len"
    return (f"submit again with --micro-batch-size {micro} --grad-accum-steps {per_rank // micro} --force (the same "
            "global batch in smaller micro batches)")


def num_flops_per_token(model: Any, seq_len: int) -> int:
    """Training FLOPs per token of `model` (a ModelSection), torchtitan's 6 * N + 12 * L * H * Q * T:
    forward (2) and backward (4) FLOPs for each parameter N that does a matmul (every layer and the
    output projection with its padded rows; not the input embedding, a lookup; a tied matrix once),
    and the attention score and value matmuls (H heads of size Q, context T)."""
    n_matmul = model.num_params() - model.padded_vocab_size * model.hidden_size * (0 if model.tie_embeddings else 1)
    return 6 * n_matmul + 12 * model.num_layers * model.num_heads * model.head_dim * seq_len


def block_flops_per_token(model: Any, seq_len: int) -> int:
    """Training FLOPs per token of one transformer block of `model` (as `num_flops_per_token`)."""
    h, kv = model.hidden_size, model.num_kv_heads * model.head_dim
    return 6 * (2 * h * h + 2 * h * kv + 3 * h * model.intermediate_size) + 12 * h * seq_len


# What a CPU step spends beyond its blocks' and output layer's matmuls (embedding, optimizer, gloo,
# data, Python) does not depend on the dtype: about this share of their float32 time (BENCHMARKS.md).
CPU_STEP_OVERHEAD = 0.5


def cpu_step_seconds(cfg: Any, rates: dict[str, dict[str, float]], dtype: str) -> float:
    """CPU seconds one rank spends on a step of `cfg` in `dtype`, where its block and output layer
    run at `rates[dtype]` (FLOP a CPU second: trainer/probe.py), with CPU_STEP_OVERHEAD of float32's."""
    m, p, t, seq = cfg.model, cfg.parallel, cfg.train, cfg.data.seq_len
    tokens = t.micro_batch_size * t.grad_accum_steps * seq  # a data-parallel rank's, each step
    block = -(-m.num_layers // p.pp) * block_flops_per_token(m, seq) / p.tp
    head = 6 * m.hidden_size * m.padded_vocab_size / p.tp

    def spent(r: dict[str, float]) -> float:
        return tokens * (block / r["block"] + head / r["head"])

    return spent(rates[dtype]) + CPU_STEP_OVERHEAD * spent(rates["float32"])


def checkpoint_bytes(num_params: int) -> int:
    """One more checkpoint's bytes: the fp32 weights and AdamW's two moments, about 12 a parameter."""
    return 12 * num_params

