"""How each transformer block computes: activation checkpointing, torch.compile, float8, applied
in trainer/parallel.py's order. None changes a parameter name: checkpoints stay layout- and
option-independent.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from common.errors import ConfigError
from trainer.config import TrainSection
from trainer.model import Transformer


def _selective_save_ops() -> set:
    """Ops whose outputs selective (per-op) checkpointing keeps: the matmuls, attention and
    communication that cost most to recompute (torchtitan's list). Resolved by name, as not
    every op exists in every torch build (the CPU flash kernel, flash-attn's own op)."""
    names = [("aten", "mm"), ("aten", "_scaled_dot_product_efficient_attention"),
             ("aten", "_scaled_dot_product_flash_attention"), ("aten", "_scaled_dot_product_cudnn_attention"),
             ("aten", "_scaled_dot_product_flash_attention_for_cpu"), ("flash_attn", "_flash_attn_forward"),
             ("_c10d_functional", "reduce_scatter_tensor"),
             ("aten", "max")]  # float8: the amax its scales come from
    ops = set()
    for namespace, name in names:
        try:
            ops.add(getattr(getattr(torch.ops, namespace), name).default)
        except (AttributeError, RuntimeError):
            pass
    return ops


def _selective_op_context() -> tuple:
    """A fresh per-op policy for one checkpointed call: keep the outputs of the ops above, but
    recompute every second matmul (torchtitan's balance of memory and compute)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save_ops = _selective_save_ops()
    mm = torch.ops.aten.mm.default
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[mode] += 1
        keep = func in save_ops and not (func == mm and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: Transformer, mode: str, selective: str) -> None:
    """train.activation_checkpointing on every block this stage holds (see TransformerBlock.forward).
    selective "N" recomputes the blocks whose global index i has (i + 1) % N == 0."""
    from torch.utils.checkpoint import noop_context_fn

    if mode == "none":
        return
    for name, layer in model.layers.items():
        if mode == "full":
            layer.recompute = noop_context_fn
        elif selective == "op":
            layer.recompute = _selective_op_context
        elif (int(name) + 1) % int(selective) == 0:
            layer.recompute = noop_context_fn


def compile_blocks(model: Transformer, backend: str = "inductor") -> None:
    """torch.compile each block in place (parameter names keep no _orig_mod prefix). Not
    fullgraph: a graph break runs on, slower, and `graph_break_report` names it at the first
    step. `backend` other than inductor is for tests (eager: dynamo's tracing, no codegen)."""
    for layer in model.layers.values():
        layer.compile(backend=backend)


def reset_graph_breaks() -> None:
    """Forget the graph breaks counted so far (dynamo's counters are per process)."""
    from torch._dynamo.utils import counters

    counters["graph_break"].clear()


def graph_breaks() -> dict[str, int]:
    """Graph breaks since `reset_graph_breaks`, by reason (dynamo's own counter; torch 2.10-2.13)."""
    from torch._dynamo.utils import counters

    return {str(reason): int(n) for reason, n in counters["graph_break"].items()}


def graph_break_report() -> str:
    """One line for the first step's log: how many graph breaks and where (the top reasons)."""
    breaks = graph_breaks()
    if not breaks:
        return "compile: 0 graph breaks (every block one graph)"
    top = sorted(breaks.items(), key=lambda kv: -kv[1])[:3]
    reasons = "; ".join(f"{n}x {' '.join(reason.split())[:160]}" for reason, n in top)
    return (f"compile: {sum(breaks.values())} graph breaks, each a slowdown (TORCH_LOGS=graph_breaks shows them "
            f"whole): {reasons}")


def compile_error(exc: BaseException) -> Optional[ConfigError]:
    """A torch.compile failure (dynamo or inductor: on the first call of each block, so the runners'
    first step is where it shows) as one line naming the way out; None for any other exception."""
    from torch._dynamo.exc import TorchDynamoException

    chain, seen = exc, set()
    while chain is not None and id(chain) not in seen:  # inductor's errors arrive wrapped
        seen.add(id(chain))
        if isinstance(chain, TorchDynamoException) or type(chain).__module__.startswith("torch._inductor"):
            first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
            return ConfigError("train.compile", f"torch.compile failed ({type(exc).__name__}: {first[:300]}): set "
                                                "train.compile: false to train without compiling, or fix the compiler "
                                                "(inductor needs a working C++ compiler on the CPU and triton on CUDA)")
        chain = chain.__cause__ or chain.__context__
    return None


def check_float8(cfg: TrainSection, device: torch.device) -> None:
    """train.float8 where it can run, or a ConfigError saying why not. Before any data work."""
    if not cfg.float8:
        return
    if device.type != "cuda":
        raise ConfigError("train.float8", f"float8 matmuls need a CUDA GPU of compute capability >= 8.9 (H100, "
                                          f"GH200), but this run is on {device.type}: set train.float8: false")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):  # Ada and Hopper (H100, GH200) have float8 tensor cores
        raise ConfigError("train.float8", f"{torch.cuda.get_device_name(device)} has compute capability "
                                          f"{capability[0]}.{capability[1]}, float8 needs >= 8.9 (H100, GH200): "
                                          "set train.float8: false")
    require_torchao()


FLOAT8_EXTRA = "float8"  # pyproject's optional dependencies: slipway[float8] installs torchao


def require_torchao() -> None:
    """torchao's float8 training, or a one-line ConfigError naming the extra that installs it."""
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except ImportError as exc:
        raise ConfigError("train.float8", f"float8 training needs torchao, which does not import ({exc}): "
                                          f"rebuild the image for this config (`slipway image build CONFIG` "
                                          f"installs the {FLOAT8_EXTRA} extra where train.float8 is on), or pip "
                                          f"install 'slipway[{FLOAT8_EXTRA}]' outside one, or set "
                                          "train.float8: false") from None


def apply_float8(model: Transformer, recipe: str = "rowwise") -> None:
    """The blocks' linear layers as torchao Float8Linear scaled by `recipe`. The output projection stays
    bf16 (the logits are sensitive; one matmul of many), as does any linear whose dimensions are not
    multiples of 16 (float8 matmul's tiling)."""
    require_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and fqn.startswith("layers.")
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
