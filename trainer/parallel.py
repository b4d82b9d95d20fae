"""Process groups, the device mesh, and how the model is split across it.

All mesh arithmetic lives here (`ParallelDims`): a 3-D mesh ("pp", "dp", "tp") with tp innermost,
so tensor-parallel peers are neighbouring ranks (on one node). Whatever the layout, `build_model`
builds the model in torchtitan's order (its parallelize.py):

    meta-device Transformer -> this pipeline stage's layers -> float8 linears (optional) -> tensor
    parallel (logits vocabulary-sharded under loss parallel) -> activation checkpointing ->
    torch.compile per block (it sees the recomputation) -> FSDP2 (its hooks outside the compiled
    blocks) -> allocate on the device -> seeded init of each rank's shard -> (DDP wraps last)
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.compute import apply_ac, apply_float8, compile_blocks
from common import environ
from common.errors import ConfigError
from trainer.config import ParallelSection, TrainerConfig
from common.layouts import resolve_reshard
from trainer.model import Transformer

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs_BT, targets_BT)


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # we created the process group, so we destroy it


def _env_from_slurm() -> None:
    """srun starts one task per process and sets SLURM_*; torch wants RANK & co."""
    for torch_name, slurm_name in (("RANK", "SLURM_PROCID"), ("LOCAL_RANK", "SLURM_LOCALID"),
                                   ("WORLD_SIZE", "SLURM_NTASKS")):
        if torch_name not in os.environ and slurm_name in os.environ:
            os.environ[torch_name] = os.environ[slurm_name]


def set_group_timeout(timeout: Optional[timedelta], group: Optional[dist.ProcessGroup] = None) -> None:
    """`timeout` (trainer.watchdog.collective_timeout) on `group` (the default one when None):
    torch gives groups made without one its backend default (NCCL 10 min, gloo 30 min), the
    device mesh's included, whatever the default group's timeout."""
    if timeout is not None and dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def init_distributed(timeout: Optional[timedelta] = None) -> DistEnv:
    """Join (or create) the default process group (nccl on CUDA, gloo on CPU) with `timeout`: for one
    process too where a launcher gave it a rendezvous (a 1-GPU job then runs an 8-GPU one's NCCL
    collectives); a plain `python -m trainer` has none."""
    _env_from_slurm()
    rank = environ.count("RANK") or 0
    local_rank = environ.count("LOCAL_RANK") or 0
    world_size = environ.count("WORLD_SIZE") or 1
    launched = world_size > 1 or ("WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
                                  and "MASTER_PORT" in os.environ)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owns = False
    if launched and not dist.is_initialized():
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise ConfigError("launch", f"WORLD_SIZE is {world_size} but {' and '.join(missing)} {verb} not set: "
                              "launch with torchrun, or export them in the batch script before srun")
        if rank != 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # torchrun's store is up
            await_store(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                                device_id=device if device.type == "cuda" else None, timeout=timeout)
        owns = True
    elif dist.is_initialized():  # a launcher's or a test's group: ours from here on
        rank, world_size = dist.get_rank(), dist.get_world_size()
        set_group_timeout(timeout)
    return DistEnv(rank, local_rank, world_size, device, owns)


def await_store(host: str, port: str, within: float = 60.0) -> None:
    """Wait (at most `within` s) until rank 0's store at host:port takes connections: torch's client,
    when it comes first, retries only after about half a second, which warm ranks paid on most launches
    (bench/devloop.py). Tries 10 ms apart at first, at most 100 ms (a thousand ranks on a slow rank 0).
    A bad name or port, or no store in time, returns: init_process_group then reports or waits."""
    if not (port.isdigit() and 0 < int(port) < 65536):
        return
    deadline, pause = time.monotonic() + within, 0.01
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except (ConnectionRefusedError, socket.timeout):
            time.sleep(pause)
            pause = min(2 * pause, 0.1)
        except OSError:
            return


@contextlib.contextmanager
def distributed_session(timeout: Optional[timedelta] = None) -> Iterator[DistEnv]:
    env = init_distributed(timeout)
    try:
        yield env
    finally:
        if env.owns_group and dist.is_initialized():
            dist.destroy_process_group()


MESH_DIMS = ("pp", "dp", "tp")  # tp innermost: tensor-parallel peers are neighbouring ranks


@dataclass
class ParallelDims:
    cfg: ParallelSection
    world_size: int
    mesh: Optional[DeviceMesh] = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg: ParallelSection, world_size: int) -> "ParallelDims":
        if cfg.world_size != world_size:
            raise ConfigError("parallel", f"dp({cfg.dp}) x tp({cfg.tp}) x pp({cfg.pp}) = {cfg.world_size} != "
                              f"world size {world_size}: launch {cfg.world_size} processes "
                              f"or change parallel.dp/tp/pp so that their product is {world_size}")
        dims = cls(cfg, world_size)
        if dims.ddp and cfg.dp > 1 and (cfg.tp > 1 or cfg.pp > 1):
            # DDP cannot reduce DTensor (tensor-parallel) gradients, and its bucket
            # rebuild breaks on a pipeline's several backwards per step (torchtitan
            # also keeps DDP 1-D).
            raise ConfigError("parallel.dp_mode", f"DDP (dp_mode ddp or zero_stage 0) is data parallel only, but "
                              f"tp is {cfg.tp} and pp is {cfg.pp}: use dp_mode fsdp with zero_stage 1, 2 or 3")
        return dims

    def build_mesh(self, device_type: str, timeout: Optional[timedelta] = None) -> None:
        if self.world_size > 1:
            self.mesh = init_device_mesh(device_type, (self.cfg.pp, self.cfg.dp, self.cfg.tp), mesh_dim_names=MESH_DIMS)
            for dim in range(self.mesh.ndim):
                set_group_timeout(timeout, self.mesh.get_group(dim))

    @property
    def dp(self) -> int:
        return self.cfg.dp

    @property
    def tp(self) -> int:
        return self.cfg.tp

    @property
    def pp(self) -> int:
        return self.cfg.pp

    @property
    def ddp(self) -> bool:
        """Replicated data parallel (DDP) rather than FSDP2."""
        return self.cfg.dp_mode == "ddp" or self.cfg.zero_stage == 0

    @property
    def loss_parallel(self) -> bool:
        """Cross-entropy on vocabulary-sharded logits (tensor parallel only)."""
        return self.cfg.tp > 1 and self.cfg.loss_parallel

    def submesh(self, name: str) -> Optional[DeviceMesh]:
        return self.mesh[name] if self.mesh is not None and getattr(self, name) > 1 else None

    def local_rank(self, name: str) -> int:
        sub = self.submesh(name)
        return sub.get_local_rank() if sub is not None else 0

    @property
    def dp_rank(self) -> int:
        return self.local_rank("dp")

    @property
    def pp_rank(self) -> int:
        return self.local_rank("pp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def pp_group(self) -> Optional[dist.ProcessGroup]:
        sub = self.submesh("pp")
        return sub.get_group() if sub is not None else None


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges per stage, the first stages taking one extra when uneven."""
    sizes = [num_layers // pp + (1 if s < num_layers % pp else 0) for s in range(pp)]
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def split_for_stage(model: Transformer, stage: int, pp: int) -> None:
    """Delete what this stage does not run; names of what is left stay full-model names."""
    keep = {str(i) for i in stage_layers(len(model.layers), pp)[stage]}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != pp - 1:
        model.norm = None
        model.output = None


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool = False) -> None:
    """Megatron-style tensor parallel (torchtitan's plan): q/k/v and gate/up split by columns, o and down
    by rows; sequence parallel splits the norms and the residual stream along the sequence. Without
    loss parallel the logits are gathered whole (3.3 GB of bf16 a GPU for tiny_wikitext, plus fp32)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    residual = Shard(1) if sequence_parallel else Replicate()
    top_plan = {}
    if model.tok_embeddings is not None:
        top_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.norm is not None and sequence_parallel:
        top_plan["norm"] = SequenceParallel()
    if model.output is not None:
        top_plan["output"] = ColwiseParallel(input_layouts=residual,
                                             output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                             use_local_output=not loss_parallel)
    parallelize_module(model, tp_mesh, top_plan)
    for layer in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        }
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, tp_mesh, plan)
    _retie(model)


def _retie(model: Transformer) -> None:
    """Tied embeddings one parameter again after sharding or materialising them apart (both Shard(0) under TP)."""
    if model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, zero_stage: int, param_dtype: torch.dtype,
               reshard_after_forward: Optional[bool] = None) -> None:
    """FSDP2 per block, then the root; resharded after the forward at zero_stage 3 unless
    `reshard_after_forward` (common.layouts.resolve_reshard's) says. Parameters stay fp32 (the
    optimizer's master copy); compute is in `param_dtype`, gradients are reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # With a padded vocabulary the root returns logits[..., :vocab_size], a view; FSDP2 (torch
    # 2.13, not 2.10) warns that an in-place op on it would lose its backward hook. The loss
    # reads it out of place, so the warning (every rank, every run) says nothing here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                            category=UserWarning)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # A block's floating-point inputs are the residual stream (already param_dtype: the root's
    # embedding computes in it) and the RoPE tables, which stay fp32: cast to bf16 they would
    # put an error of up to 2^-8 into every rotation. So blocks cast no inputs; the root does.
    block_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    reshard = zero_stage == 3 if reshard_after_forward is None else reshard_after_forward
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=block_mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def build_model(cfg: TrainerConfig, dims: ParallelDims, device: torch.device, dtype: torch.dtype,
                attn_impl: str = "sdpa") -> nn.Module:
    """This rank's part of the model (module docstring), on `device`, initialised from cfg.run.seed."""
    with torch.device("meta"):
        model = Transformer(cfg.model, attn_impl)
    if dims.pp > 1:
        split_for_stage(model, dims.pp_rank, dims.pp)
    if cfg.train.float8:  # check_float8 has vouched for the device
        apply_float8(model, cfg.train.float8_recipe)
    if dims.tp > 1:
        apply_tp(model, dims.submesh("tp"), cfg.parallel.sequence_parallel, dims.loss_parallel)
    apply_ac(model, cfg.train.activation_checkpointing, cfg.train.selective_ac)
    if cfg.train.compile:
        compile_blocks(model)
    if dims.dp > 1 and not dims.ddp:
        apply_fsdp(model, dims.submesh("dp"), cfg.parallel.zero_stage, dtype, resolve_reshard(cfg)[0])
    model.to_empty(device=device)
    _retie(model)
    model.init_weights(cfg.run.seed)
    if cfg.model.init_from_hf:  # full fine-tuning from a local Hugging Face Llama
        from trainer.hf import load_hf_into

        load_hf_into(model, Path(cfg.model.init_from_hf), cfg.model)
    if dims.dp > 1 and dims.ddp:
        return nn.parallel.DistributedDataParallel(model, process_group=dims.submesh("dp").get_group(),
                                                   device_ids=[device.index] if device.type == "cuda" else None)
    return model


def step_stats(loss: torch.Tensor, grad_norm: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """[mean loss over dp ranks, gradient norm, 1.0 if any rank's loss or the norm is not finite]
    on the device, from one all-reduce and no host sync. Last-stage ranks hold the loss (0
    elsewhere) and every tp peer the same one, so the world sum is divided by dp x tp. A NaN
    loss on any rank makes the sum NaN and the count > 0 everywhere: all ranks skip together."""
    both = torch.stack([loss.detach().float(), (~torch.isfinite(loss.detach())).float()])
    if dist.is_initialized():  # a group of one too: its collectives are the ones a large job runs
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    mean = both[0] / (dims.dp * dims.tp) if dist.is_initialized() else both[0]
    bad = torch.maximum((both[1] > 0).float(), (~torch.isfinite(grad_norm)).float())
    return torch.stack([mean, grad_norm.float(), bad])


def global_mean(local: torch.Tensor, dims: ParallelDims) -> float:
    """Mean over data-parallel ranks of a value held by last-stage ranks (as `step_stats` divides)."""
    value = local.detach().float().clone()
    if dist.is_initialized():  # a group of one too: its collectives are the ones a large job runs
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dims.dp * dims.tp
    return value.item()
