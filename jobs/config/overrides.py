"""The command line's side of the config: its named flags for config keys, and `key=value`
overrides, parsed and set into the raw tree before it is read.
"""

from __future__ import annotations

from typing import Any, Callable

from common.errors import ConfigError
from common.yaml import Plain, read_yaml

# The command line's names for config keys (`slipway submit CONFIG --nodes 2` is slurm.nodes=2), read by
# the CLI and by the hints that turn a command back into overrides: (flag, dotted key, type, help).
NAMED_FLAGS: list[tuple[str, str, Callable[[str], Any], str]] = [
    ("--run-name", "run.name", str, "run name: the run directory runs/NAME and the Slurm job name"),
    ("--project", "run.project", str, "project name for logging (W&B)"),
    ("--seed", "run.seed", int, "random seed"),
    ("--nodes", "slurm.nodes", int, "number of nodes"),
    ("--gpus-per-node", "slurm.gpus_per_node", int, "GPUs per node (0 for CPU runs)"),
    ("--procs-per-node", "launch.procs_per_node", int, "processes per node (default: gpus per node)"),
    ("--model-size", "model.size", str, "tiny | small | base | large | custom"),
    ("--hidden-size", "model.hidden_size", int, "model hidden size"),
    ("--intermediate-size", "model.intermediate_size", int, "MLP intermediate size"),
    ("--num-layers", "model.num_layers", int, "number of layers"),
    ("--num-heads", "model.num_heads", int, "attention heads"),
    ("--num-kv-heads", "model.num_kv_heads", int, "key/value heads (grouped-query attention)"),
    ("--dp", "parallel.dp", int, "data-parallel degree"),
    ("--tp", "parallel.tp", int, "tensor-parallel degree"),
    ("--pp", "parallel.pp", int, "pipeline-parallel degree"),
    ("--train-steps", "train.steps", int, "training steps"),
    ("--micro-batch-size", "train.micro_batch_size", int, "sequences per micro batch per data-parallel rank"),
    ("--grad-accum-steps", "train.grad_accum_steps", int, "micro batches per step"),
    ("--learning-rate", "train.lr", float, "peak learning rate"),
    ("--min-lr", "train.min_lr", float, "learning rate at the end of the decay"),
    ("--warmup-steps", "train.warmup_steps", int, "linear warmup steps"),
    ("--weight-decay", "train.weight_decay", float, "AdamW weight decay"),
    ("--grad-clip", "train.grad_clip", float, "gradient clipping by global norm (0: off)"),
    ("--train-script", "train.script", str, "a custom training script run instead of the built-in trainer"),
    ("--dataset", "data.dataset", str, "Hugging Face dataset name or local path"),
    ("--dataset-config", "data.dataset_config", str, "dataset configuration, e.g. wikitext-103-v1"),
    ("--tokenizer", "data.tokenizer", str, "tokenizer name or local path"),
    ("--text-column", "data.text_column", str, "text column of the dataset"),
    ("--seq-len", "data.seq_len", int, "sequence length"),
    ("--save-interval", "checkpoint.interval", int, "checkpoint every N steps"),
]
# Named flags of the Slurm allocation and the container: a run on this machine (`slipway local`)
# has neither, so its --help leaves them out (it still reads them, as the config's own values).
# The layout's --nodes, --gpus-per-node and --procs-per-node stay above: the config's layout
# check names them, and a local run maps them onto its processes.
CLUSTER_FLAGS: list[tuple[str, str, Callable[[str], Any], str]] = [
    ("--cpus-per-task", "slurm.cpus_per_task", int, "CPUs per Slurm task"),
    ("--partition", "slurm.partition", str, "Slurm partition"),
    ("--account", "slurm.account", str, "Slurm account"),
    ("--qos", "slurm.qos", str, "Slurm QOS"),
    ("--time", "slurm.time", str, "time limit: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]] or UNLIMITED"),
    ("--email", "slurm.email", str, "mail on job end or failure"),
    ("--runtime", "container.runtime", str, "edf | pyxis | none"),
    ("--image", "container.image", str, "squashfs path (absolute or ./) or registry reference"),
    ("--launcher", "launch.launcher", str, "auto | torchrun (one task per node) | srun (one task per process)"),
]
BOOL_FLAGS = [
    ("--save-initial-state", "checkpoint.save_initial", "save a checkpoint before the first step"),
    ("--debug", "launch.debug", "debug mode: set -x, CUDA_LAUNCH_BLOCKING, NCCL_DEBUG=INFO"),
    ("--wandb", "logging.wandb", "log to Weights & Biases (offline unless WANDB_API_KEY is set)"),
]


def parse_value(text: str, key: str = "") -> Any:
    """An override's value: the text itself (typed later by the field it sets, so
    `slurm.time=10:00` stays "10:00"), a list `[a, b]`, or a YAML flow mapping `{k: v}`."""
    stripped = text.strip()
    if stripped.startswith("[") and stripped.endswith("]"):
        return _split_list(stripped[1:-1], key)
    if stripped.startswith(("[", "{")):
        return read_yaml(text, key or "override", lines=False)
    return Plain(text)


def _split_list(inner: str, key: str) -> list[str]:
    """`a, ${X}:/b, "c, d"`: items split at commas outside quotes and `${...}` (a YAML flow
    list cannot hold `${VAR}`, which mounts need); quoted items as YAML reads them."""
    items, current, quote, depth, escaped = [], "", "", 0, False
    for i, ch in enumerate(inner):
        if escaped:  # in double quotes a backslash takes the next character, whatever it is
            escaped = False
        elif quote:
            escaped, quote = ch == "\\" and quote == '"', "" if ch == quote else quote
        elif ch in "\"'" and not current.strip():
            quote = ch
        elif inner.startswith("${", i):
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
        elif ch == "," and not depth:
            items.append(current)
            current = ""
            continue
        current += ch
    if quote:
        raise ConfigError(key or "override", f"unterminated {quote} in [{inner}]: close the quote")
    if current.strip() or items:
        items.append(current)
    return [read_yaml(item, key or "override", lines=False) if item[:1] in "\"'" and len(item) >= 2
            and item[-1] == item[0] else Plain(item) for item in (it.strip() for it in items)]


# Mappings whose keys may hold dots themselves (annotations such as com.hooks.x.enabled).
MAP_FIELDS = ("container.env", "container.annotations", "launch.env", "image.build_args")


def apply_override(raw: dict, dotted: str, value: Any) -> None:
    """Set `section.key[.sub]` in the raw tree; errors name the bad key."""
    parts = dotted.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(dotted, "an override must look like section.key=value, e.g. train.steps=100")
    if len(parts) > 2 and ".".join(parts[:2]) in MAP_FIELDS:
        parts = parts[:2] + [".".join(parts[2:])]
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section; cannot set a key inside it")
        node = child
    node[parts[-1]] = value
