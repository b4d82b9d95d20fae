"""The trainer's sections of the one config tree (run, model, parallel, data, train,
checkpoint, logging) and the rules across them. No torch and no host side: the host's
`jobs.config.Config` extends `TrainerConfig` with its own sections, and the image reads
runs/RUN/config.yaml back into these alone, through common/schema.py's checks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from common.errors import ConfigError, shown
from common.schema import BIG, DAY, AutoBool, at_most, config_fields, from_dict, positive, require
from common.yaml import read_text_bounded, read_yaml


# The CSCS tutorial's 109M Llama is `tiny`; the others follow common Llama shapes.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=768, intermediate_size=1536, num_layers=12, num_heads=12, num_kv_heads=12,
                 vocab_size=50257, max_position_embeddings=512, tie_embeddings=True),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_layers=24, num_heads=16, num_kv_heads=8,
                  vocab_size=50257, max_position_embeddings=2048, tie_embeddings=True),
    "base": dict(hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4,
                 vocab_size=32000, max_position_embeddings=2048, tie_embeddings=False),
    "large": dict(hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
                  vocab_size=32000, max_position_embeddings=4096, tie_embeddings=False),
}
MODEL_DIMENSIONS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
               "vocab_size", "max_position_embeddings")


@dataclass
class RunSection:
    """Names the run and seeds it."""

    # The run's name: its directory runs/NAME and the Slurm job name (`--run-name`); default: the
    # config file's name.
    name: str = ""
    # The Weights & Biases project the run logs to (logging.wandb).
    project: str = "slipway"
    # Seeds the model's initialisation and the order of the training windows.
    seed: int = 42


@dataclass
class ModelSection:
    """Llama decoder dimensions. `size` names a preset; any dimension given
    beside it overrides the preset; `size: custom` needs every dimension."""

    # A preset's dimensions (tiny, small, base, large: see the table below), or custom: every
    # dimension given.
    size: Literal["tiny", "small", "base", "large", "custom"] = "tiny"
    # Width of the residual stream; null: the size preset's (so for the dimensions below).
    hidden_size: Optional[int] = None
    # Width of the SwiGLU feed-forward layer; null: the preset's.
    intermediate_size: Optional[int] = None
    # Transformer blocks; null: the preset's.
    num_layers: Optional[int] = None
    # Attention heads (hidden_size must be divisible by it); null: the preset's.
    num_heads: Optional[int] = None
    # Key/value heads (grouped-query attention; num_heads must be divisible by it); null: the
    # preset's.
    num_kv_heads: Optional[int] = None
    # Token vocabulary, the tokenizer's (4096 for builtin, 50257 for gpt2); null: the preset's.
    vocab_size: Optional[int] = None
    # The longest sequence the model takes (data.seq_len at most); null: the preset's.
    max_position_embeddings: Optional[int] = None
    # Share the token embedding with the output projection; default: the preset's, false for custom.
    tie_embeddings: Optional[bool] = None
    # Base of the rotary embeddings' frequencies.
    rope_theta: float = 10000.0
    # Epsilon of RMSNorm.
    rms_norm_eps: float = 1e-5
    # Standard deviation of the weights' normal initialisation (residual output projections get
    # init_std / sqrt(2 x num_layers)).
    init_std: float = 0.025
    # flash (flash-attn: CUDA and bf16/fp16 only), sdpa (torch's scaled_dot_product_attention), or
    # auto: flash-attn where it imports on a CUDA bf16/fp16 run (required in an image built with
    # it), SDPA elsewhere.
    attention: Literal["auto", "flash", "sdpa"] = "auto"
    # A local Hugging Face Llama checkpoint to start from (full fine-tuning); null: random weights.
    init_from_hf: Optional[str] = None
    # Embedding and output rows are padded to a multiple of this (nanoGPT's 50257 -> 50304):
    # matmuls tile better and tp divides the rows. The padding does not depend on tp, so a
    # checkpoint loads into any layout; the loss only ever sees the real vocab_size logits.
    pad_vocab_multiple: int = 64

    def __post_init__(self) -> None:
        for key, value in MODEL_PRESETS.get(self.size, {"tie_embeddings": False}).items():  # custom: untied
            if getattr(self, key) is None:
                setattr(self, key, value)

    def check(self, where: str) -> None:
        if self.size == "custom":
            missing = [d for d in MODEL_DIMENSIONS if getattr(self, d) is None]
            require(not missing, f"{where}.{missing[0] if missing else ''}",
                    f"model.size is custom, so {', '.join(missing)} must be set (or pick a preset: "
                    f"{', '.join(MODEL_PRESETS)})")
        positive(self, where, *MODEL_DIMENSIONS, "init_std")
        at_most(self, where, hidden_size=2 ** 17, intermediate_size=2 ** 19, num_layers=4096, num_heads=4096,
                num_kv_heads=4096, vocab_size=2 ** 24, max_position_embeddings=2 ** 24, pad_vocab_multiple=2 ** 16)
        require(self.hidden_size % self.num_heads == 0, f"{where}.num_heads",
                f"hidden_size({self.hidden_size}) must be divisible by num_heads({self.num_heads})")
        require(self.num_heads % self.num_kv_heads == 0, f"{where}.num_kv_heads",
                f"num_heads({self.num_heads}) must be divisible by num_kv_heads({self.num_kv_heads})")
        require((self.hidden_size // self.num_heads) % 2 == 0, f"{where}.num_heads",
                f"head dimension hidden_size/num_heads = {self.hidden_size // self.num_heads} must be even "
                "for rotary embeddings")
        require(self.pad_vocab_multiple >= 1, f"{where}.pad_vocab_multiple",
                f"must be >= 1 (1 disables padding), got {self.pad_vocab_multiple}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the output: vocab_size rounded up to pad_vocab_multiple."""
        return -(-self.vocab_size // self.pad_vocab_multiple) * self.pad_vocab_multiple

    def num_params(self) -> int:
        """Parameter count as allocated (padded vocabulary rows included; embeddings once when tied)."""
        h, i, layers, v = self.hidden_size, self.intermediate_size, self.num_layers, self.padded_vocab_size
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_embeddings else 2)
        return layers * per_layer + embed + h


@dataclass
class ParallelSection:
    """How the ranks share the work: dp x tp x pp must equal nodes x procs_per_node."""

    # Data-parallel degree.
    dp: int = 1
    # Tensor-parallel degree: model.num_heads, num_kv_heads and intermediate_size must divide by it.
    tp: int = 1
    # Pipeline-parallel degree (stages of model.num_layers); needs untied embeddings and
    # train.grad_accum_steps >= pp.
    pp: int = 1
    # fsdp (FSDP2: parameters, gradients and optimizer state sharded over dp) or ddp (replicated;
    # zero_stage 0, no tp or pp).
    dp_mode: Literal["fsdp", "ddp"] = "fsdp"
    # ZeRO stage under fsdp (parameters, gradients and optimizer state are always sharded): 3 makes
    # reshard_after_forward's auto reshard; 1 and 2 behave alike (as ZeRO-2). 0 means DDP.
    zero_stage: Literal[0, 1, 2, 3] = 1
    # Under tp, also shard the activations between blocks over the sequence (data.seq_len must
    # divide by tp).
    sequence_parallel: bool = False
    # The pipeline schedule.
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    # Under tp > 1 the output projection's logits stay sharded over the (padded) vocabulary
    # and the cross-entropy is computed on the shards (torch's loss_parallel): no rank holds
    # the whole [batch, seq, vocab] logits, their fp32 copy or their gradient. No effect at tp 1.
    loss_parallel: bool = True
    # With grad_accum_steps > 1, gradients are reduced across dp ranks once, after the last
    # micro batch (FSDP2 accumulates them unsharded, DDP under no_sync): one reduce-scatter a
    # step instead of one a micro batch, for a full-size gradient buffer on each rank.
    # every_micro_batch reduces after each (less memory, more communication).
    grad_sync: Literal["last_micro_batch", "every_micro_batch"] = "last_micro_batch"
    # FSDP2: free each block's gathered parameters after its forward (all-gathered again for the
    # backward) or keep them to the backward. auto: zero_stage 3 reshards; otherwise the model
    # preset's default (common/layouts.py: on for large, whose bf16 weights would take 13 GB
    # a GPU), else off. true or false decide, whatever zero_stage says.
    reshard_after_forward: AutoBool = "auto"

    def check(self, where: str) -> None:
        positive(self, where, "dp", "tp", "pp")
        at_most(self, where, dp=2 ** 20, tp=2 ** 20, pp=2 ** 20)
        if self.dp_mode == "ddp":
            require(self.zero_stage == 0, f"{where}.zero_stage",
                    f"dp_mode ddp replicates everything, so zero_stage must be 0 (got {self.zero_stage}); "
                    "use dp_mode fsdp for ZeRO 1-3")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass
class DataSection:
    """Hugging Face dataset by name or a local path (saved dataset, parquet,
    jsonl or text files); tokenizer by name or local path. `builtin` is the
    corpus and tokenizer that ship with the project (no network)."""

    # A Hugging Face dataset name, a local path, or builtin.
    dataset: str = "builtin"
    # The dataset's configuration, e.g. wikitext-103-v1.
    dataset_config: Optional[str] = None
    # The split trained on.
    split: str = "train"
    # The column holding the text.
    text_column: str = "text"
    # A Hugging Face tokenizer name, a tokenizer.json, a folder holding one (or the vocab files
    # transformers converts, where it is installed), or builtin.
    tokenizer: str = "builtin"
    # Tokens per training window.
    seq_len: int = 512
    # A split to evaluate on (for local file datasets, a path); null: the last
    # validation_fraction of the training tokens.
    validation_split: Optional[str] = None
    # Share of the training tokens held out for evaluation when validation_split is null.
    validation_fraction: float = 0.01
    cache_dir: Optional[str] = None  # the token cache; default <project>/.cache/tokens
    num_proc: int = 0  # tokenizer threads; 0 = every core the process may use
    # Let global rank 0 tokenize a cache entry `slipway prepare` has not made,
    # while every other rank (and GPU) waits. Off: the job stops at once and
    # says to run `slipway prepare`. The builtin corpus is always allowed
    # (it ships in the image and takes about a second).
    tokenize_in_job: bool = False

    def check(self, where: str) -> None:
        positive(self, where, "seq_len")
        at_most(self, where, seq_len=2 ** 24, num_proc=4096)
        require(0.0 <= self.validation_fraction < 0.5, f"{where}.validation_fraction",
                f"must be in [0, 0.5), got {self.validation_fraction}")
        require(self.num_proc >= 0, f"{where}.num_proc", f"must be >= 0 (0 = all cores), got {self.num_proc}")


@dataclass
class TrainSection:
    """The optimisation: steps, batch, AdamW and its schedule, precision, memory and speed trade-offs,
    evaluation and the hang watchdog."""

    # Optimizer steps of the whole run (a resumed run continues up to it).
    steps: int = 1500
    # Sequences per micro batch on each data-parallel rank.
    micro_batch_size: int = 64
    # Micro batches per optimizer step (pipeline parallelism splits the batch into them).
    grad_accum_steps: int = 1
    # Peak learning rate (AdamW).
    lr: float = 1e-3
    # Learning rate at the end of the decay.
    min_lr: float = 1e-5
    # Steps of linear warm-up to lr.
    warmup_steps: int = 150
    # How the learning rate goes from lr to min_lr after the warm-up.
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    # A run resumed past its warm-up with another train.steps (training on: `--train-steps N
    # --force`) goes on from the learning rate it reached, never back up: decay, from there to
    # min_lr at the new train.steps (in train.decay's shape); constant, that rate to the end.
    train_on: Literal["decay", "constant"] = "decay"
    # AdamW's beta1 (decay of the gradient's running mean).
    beta1: float = 0.9
    # AdamW's beta2 (decay of the squared gradient's running mean).
    beta2: float = 0.95
    # AdamW's epsilon.
    eps: float = 1e-8
    # AdamW's decoupled weight decay.
    weight_decay: float = 0.01
    # Clip the gradients' global norm to this; 0: no clipping.
    grad_clip: float = 1.0
    # Training precision: auto is bfloat16 on CUDA and float32 on the CPU.
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # torch.compile each transformer block (off by default, as torchtitan: the first step then
    # compiles for a minute or more, and on the CPU inductor's C++ build gains little). A compile
    # failure is an error naming the fix, never a silent fall-back to eager.
    compile: bool = False
    # Recompute activations in the backward instead of keeping them: none; full (every block
    # recomputed whole: least memory, about a third more compute); selective (see selective_ac).
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    # What selective recomputes: op (torchtitan's per-op policy: matmul, attention and
    # reduce-scatter outputs are kept, every second matmul and the cheap pointwise ops are
    # recomputed) or a whole number N (every N-th block is recomputed whole).
    selective_ac: str = "op"
    # float8 matmuls for the transformer blocks' linear layers (torchao, scaled as float8_recipe
    # says; the output projection stays bf16). Needs a GPU of compute capability >= 8.9 (H100,
    # GH200) and torchao, which the image gets for a config with float8 on; refused elsewhere.
    float8: bool = False
    # How float8 scales (torchao's recipes, torchtitan's names and default): rowwise (a scale
    # per row of each operand: more accurate than tensorwise), rowwise_with_gw_hp (rowwise, the
    # weight gradient in bf16: the most accurate), tensorwise (one scale per tensor: the fastest).
    float8_recipe: Literal["rowwise", "rowwise_with_gw_hp", "tensorwise"] = "rowwise"
    # The next step's batches are read (and, on CUDA, pinned and copied to the device without
    # blocking) while this step runs.
    prefetch: bool = True
    # Python's garbage collector runs only every gc_interval steps, on every rank at the same
    # step (torchtitan's GarbageCollection): a collection at a random moment on one rank stalls
    # every other rank at the next collective. 0 leaves the collector alone.
    gc_interval: int = 50
    # Steps between evaluations on the validation tokens; 0: none.
    eval_interval: int = 0
    # Global batches per evaluation (the same ones every time).
    eval_batches: int = 4
    # A training script run instead of the built-in trainer, with --config runs/RUN/config.yaml.
    script: Optional[str] = None
    # A step with a non-finite loss or gradient norm is skipped (no optimizer update);
    # this many in a row stop the run (exit 3): the weights are not coming back.
    max_nonfinite_steps: int = 5
    # Seconds without a completed step (its evaluation included; checkpoint work has a bound of
    # its own, checkpoint_timeout) before the run counts as hung: every rank writes its stacks to
    # hangs/ and exits HANG_EXIT (4), and the batch script retries without the node that did not
    # answer (trainer/watchdog.py). 0 turns the watchdog off.
    hang_timeout: float = 600.0
    # hang_timeout for the first step after a start or resume (compilation, the first batches).
    hang_timeout_first_step: float = 1800.0
    # Seconds a checkpoint save, load or prune may take: hang_timeout does not run meanwhile
    # (a save on a busy file system is no hang), this bounds it instead. Past it the run ends as
    # a slow checkpoint (exit 1, `slow checkpoint:` in events.log), not as a hang. 0: no bound.
    checkpoint_timeout: float = 1800.0

    def check(self, where: str) -> None:
        positive(self, where, "steps", "micro_batch_size", "grad_accum_steps", "lr", "eval_batches")
        at_most(self, where, steps=BIG, micro_batch_size=2 ** 20, grad_accum_steps=2 ** 20, warmup_steps=BIG,
                gc_interval=BIG, eval_interval=BIG, eval_batches=2 ** 20, max_nonfinite_steps=BIG,
                hang_timeout=30 * DAY, hang_timeout_first_step=30 * DAY, checkpoint_timeout=30 * DAY)
        require(0 <= self.min_lr <= self.lr, f"{where}.min_lr",
                f"must be between 0 and lr({self.lr}), got {self.min_lr}")
        require(self.warmup_steps >= 0, f"{where}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            require(0 <= value < 1, f"{where}.{name}", f"must be in [0, 1), got {value}")
        require(self.eps > 0 and self.weight_decay >= 0 and self.grad_clip >= 0, f"{where}.eps",
                "eps must be > 0, weight_decay and grad_clip >= 0 (grad_clip 0 disables clipping)")
        require(self.eval_interval >= 0, f"{where}.eval_interval",
                f"must be >= 0 (0 disables evaluation), got {self.eval_interval}")
        require(all(math.isfinite(getattr(self, n)) for n in ("lr", "min_lr", "eps")), f"{where}.lr",
                "lr, min_lr and eps must be finite numbers")
        require(self.max_nonfinite_steps >= 1, f"{where}.max_nonfinite_steps",
                f"must be >= 1 (the run stops after that many non-finite steps in a row), "
                f"got {self.max_nonfinite_steps}")
        require(self.selective_ac == "op" or (re.fullmatch(r"[0-9]{1,9}", self.selective_ac) is not None
                                                         and int(self.selective_ac) >= 1),
                f"{where}.selective_ac", f"must be op (per-op recomputation) or a whole number N >= 1 (every N-th "
                f"block recomputed whole), got {shown(self.selective_ac)}")
        require(self.gc_interval >= 0, f"{where}.gc_interval",
                f"must be >= 0 (0 leaves Python's garbage collector alone), got {self.gc_interval}")
        require(self.hang_timeout >= 0 and math.isfinite(self.hang_timeout), f"{where}.hang_timeout",
                f"must be >= 0 seconds (0 turns the hang watchdog off), got {self.hang_timeout}")
        require(self.checkpoint_timeout >= 0 and math.isfinite(self.checkpoint_timeout), f"{where}.checkpoint_timeout",
                f"must be >= 0 seconds (0: checkpoint work is not bounded), got {self.checkpoint_timeout}")
        require(self.hang_timeout == 0 or self.hang_timeout_first_step >= self.hang_timeout,
                f"{where}.hang_timeout_first_step", f"the first step may take longer than the others, not less: "
                f"must be >= hang_timeout ({self.hang_timeout:g}), got {self.hang_timeout_first_step:g}")


@dataclass
class CheckpointSection:
    """Distributed checkpoints: when they are saved, how many are kept and where."""

    # Steps between checkpoints; the last step, and a stop at the time-limit warning, save too.
    interval: int = 1500
    # Complete checkpoints kept; older ones are removed.
    keep_last: int = 2
    # Save the initial weights as a checkpoint (step 0) before the first step.
    save_initial: bool = False
    # Write checkpoints in the background: a save returns once the state is staged in CPU memory,
    # and the files are made visible (atomically) by the next save or the run's end; the run's last
    # save is synchronous. auto: on CUDA (the step goes on while the files are written), off on
    # the CPU (where the staging copy costs about what it saves).
    async_save: AutoBool = "auto"
    # Where checkpoints go, relative to the run directory.
    dir: str = "checkpoints"

    def check(self, where: str) -> None:
        positive(self, where, "interval", "keep_last")
        at_most(self, where, interval=BIG, keep_last=2 ** 20)


@dataclass
class LoggingSection:
    """What the run reports: metrics lines, Weights & Biases, the torch profiler."""

    # Steps between console/metrics lines. A logged step is the one place the host waits for
    # the device (the losses of the steps between stay on it), so 1 costs throughput on a GPU.
    interval: int = 10
    # Also log to Weights & Biases (offline unless WANDB_API_KEY is set).
    wandb: bool = False
    # Record optimizer steps profiler_steps with torch.profiler: a Chrome trace per rank in
    # runs/RUN/profiler/.
    profiler: bool = False
    # [first, last]: the optimizer steps the profiler records (both included).
    profiler_steps: list[int] = field(default_factory=lambda: [5, 8])
    # Level of the trainer's log messages.
    level: Literal["debug", "info", "warning"] = "info"

    def check(self, where: str) -> None:
        positive(self, where, "interval")
        at_most(self, where, interval=BIG)
        require(len(self.profiler_steps) == 2 and 0 <= self.profiler_steps[0] < self.profiler_steps[1],
                f"{where}.profiler_steps",
                f"must be [first, last] with first < last, got {shown(self.profiler_steps)}")


@dataclass
class TrainerConfig:
    """What the trainer reads from `runs/RUN/config.yaml`; host sections are skipped."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def check(self, where: str) -> None:
        check_trainer_sections(self)


def check_trainer_sections(cfg: Any) -> None:
    """Rules across trainer sections; `cfg` is a TrainerConfig or the host's full tree."""
    m, p = cfg.model, cfg.parallel
    require(m.num_heads % p.tp == 0, "parallel.tp",
            lambda: f"model.num_heads({m.num_heads}) must be divisible by parallel.tp({p.tp}): "
                    f"pick tp from {[d for d in range(1, m.num_heads + 1) if m.num_heads % d == 0]}")
    for name in ("num_kv_heads", "intermediate_size"):
        require(getattr(m, name) % p.tp == 0, "parallel.tp",
                f"model.{name}({getattr(m, name)}) must be divisible by parallel.tp({p.tp})")
    require(m.padded_vocab_size % p.tp == 0, "model.pad_vocab_multiple",
            f"the vocabulary padded to a multiple of {m.pad_vocab_multiple} ({m.padded_vocab_size} rows) must be "
            f"divisible by parallel.tp({p.tp}): set model.pad_vocab_multiple to a multiple of {p.tp}, e.g. "
            f"{math.lcm(m.pad_vocab_multiple, p.tp)}")
    require(m.num_layers >= p.pp, "parallel.pp",
            f"model.num_layers({m.num_layers}) must be >= parallel.pp({p.pp}): each stage needs a layer")
    if p.pp > 1:
        require(not m.tie_embeddings, "model.tie_embeddings",
                f"tied embeddings live on the first and last pipeline stage at once; with parallel.pp({p.pp}) "
                "set model.tie_embeddings: false or parallel.pp: 1")
        require(cfg.train.grad_accum_steps >= p.pp, "train.grad_accum_steps",
                f"pipeline parallelism splits the batch into grad_accum_steps micro batches; "
                f"grad_accum_steps({cfg.train.grad_accum_steps}) must be >= parallel.pp({p.pp})")
    if p.sequence_parallel:
        require(cfg.data.seq_len % p.tp == 0, "data.seq_len",
                f"sequence_parallel needs data.seq_len({cfg.data.seq_len}) divisible by parallel.tp({p.tp})")
    require(cfg.data.seq_len <= m.max_position_embeddings, "data.seq_len",
            f"data.seq_len({cfg.data.seq_len}) exceeds model.max_position_embeddings"
            f"({m.max_position_embeddings}): lower seq_len or raise max_position_embeddings")


def load_trainer_config(path: str | Path) -> TrainerConfig:
    """Read the trainer's sections of a resolved config."""
    path = Path(path)
    try:
        return trainer_sections(read_yaml(read_text_bounded(path, str(path)), str(path)), str(path))
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist") from None


def trainer_sections(raw: Any, where: str) -> TrainerConfig:
    """The trainer's sections of a config read as YAML from `where`."""
    if not isinstance(raw, dict):
        raise ConfigError("", f"{where} must hold a mapping of sections")
    # The host validated the whole tree when it wrote this file; its sections are not ours to read.
    ours = config_fields(TrainerConfig)
    return from_dict(TrainerConfig, {k: v for k, v in raw.items() if k in ours})
