"""One optimizer step's forward and backward over its micro batches: plain gradient accumulation
(`AccumulationRunner`) or a pipeline schedule (`PipelineRunner`). The loss is `cross_entropy` in fp32
(looked up at call time, so a test can wrap it), under loss parallel where the logits are
vocabulary-sharded.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainer.config import TrainerConfig
from trainer.parallel import Batch, ParallelDims


def cross_entropy(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32. Vocabulary-sharded logits (a DTensor, under the
    runners' loss_parallel context) give a replicated DTensor loss, returned as the plain
    tensor every tp peer holds, so the runners add it up like any other."""
    loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(0, 1))
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss


class Runner:
    """Forward and backward over one step's micro batches, without waiting for the device: the mean
    loss on ranks that compute it (the last pipeline stage), zero elsewhere (see `step_stats`). A
    subclass per layout gives `forward_backward(batches)` and `eval_step(batches)`."""

    def __init__(self, device: torch.device, autocast_dtype: Optional[torch.dtype], dims: ParallelDims):
        self.device, self.autocast_dtype, self.dims = device, autocast_dtype, dims
        # torch's cross-entropy handlers for vocabulary-sharded logits, needed for the backward too
        self.loss_context = loss_parallel if dims.loss_parallel else contextlib.nullcontext

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)


class AccumulationRunner(Runner):
    """No pipeline: the micro batches one after another, loss / n each, the data-parallel gradient
    reduction after the last only (parallel.grad_sync): FSDP2 with gradient sync and reshard after
    backward off before it, DDP under no_sync."""

    def __init__(self, model: nn.Module, autocast_dtype: Optional[torch.dtype], device: torch.device,
                 dims: ParallelDims):
        super().__init__(device, autocast_dtype, dims)
        self.model = model
        self.sync_every = dims.cfg.grad_sync == "every_micro_batch"

    def _sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Gradient reduction on (sync) or deferred for this micro batch's backward."""
        sync = sync or self.sync_every
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(sync)
            self.model.set_reshard_after_backward(sync)
            return contextlib.nullcontext()
        no_sync = getattr(self.model, "no_sync", None)  # DDP
        return no_sync() if no_sync is not None and not sync else contextlib.nullcontext()

    def forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for i, (inputs_BT, targets_BT) in enumerate(batches):
            with self._sync(i == len(batches) - 1), self.loss_context():
                with self._autocast():
                    loss = cross_entropy(self.model(inputs_BT), targets_BT) / len(batches)
                loss.backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def eval_step(self, batches: list[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        with self._autocast(), self.loss_context():
            for inputs_BT, targets_BT in batches:
                total += cross_entropy(self.model(inputs_BT), targets_BT) / len(batches)
        return total


class PipelineRunner(Runner):
    """One stage per rank; the schedule splits the concatenated micro batches back into
    grad_accum_steps. Each micro batch's loss is divided by n, rather than the schedule dividing the
    gradients afterwards: torch 2.10's in-place division of a tensor-parallel Partial gradient fails
    (and it is one pass less). Under FSDP the stage reduces gradients on the last backward only."""

    def __init__(self, model: nn.Module, dims: ParallelDims, n_microbatches: int, device: torch.device,
                 autocast_dtype: Optional[torch.dtype]):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        super().__init__(device, autocast_dtype, dims)
        stage = PipelineStage(model, dims.pp_rank, dims.pp, device, group=dims.pp_group)
        schedule_cls = Schedule1F1B if dims.cfg.pp_schedule == "1f1b" else ScheduleGPipe
        self.schedule = schedule_cls(stage, n_microbatches=n_microbatches, scale_grads=False,
                                     loss_fn=lambda logits, targets: cross_entropy(logits, targets) / n_microbatches)

    def _run(self, fn: Callable, batches: list[Batch]) -> torch.Tensor:
        inputs_BT, targets_BT = (torch.cat(tensors) for tensors in zip(*batches))
        losses: list[torch.Tensor] = []
        with self._autocast(), self.loss_context():
            if self.dims.is_first_stage:
                fn(inputs_BT)
            elif self.dims.is_last_stage:
                fn(target=targets_BT, losses=losses)
            else:
                fn()
        if self.dims.is_last_stage:  # each is loss / n: their sum is the mean
            return torch.stack([loss.detach().float() for loss in losses]).sum()
        return torch.zeros((), device=self.device)

    def forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        return self._run(self.schedule.step, batches)

    @torch.no_grad()
    def eval_step(self, batches: list[Batch]) -> torch.Tensor:
        return self._run(self.schedule.eval, batches)


def build_runner(model: nn.Module, dims: ParallelDims, cfg: TrainerConfig, device: torch.device,
                 dtype: torch.dtype) -> Runner:
    # FSDP2 casts parameters itself (MixedPrecisionPolicy); elsewhere autocast does.
    fsdp = dims.dp > 1 and not dims.ddp
    autocast_dtype = dtype if dtype != torch.float32 and not fsdp else None
    if dims.pp > 1:
        return PipelineRunner(model, dims, cfg.train.grad_accum_steps, device, autocast_dtype)
    return AccumulationRunner(model, autocast_dtype, device, dims)
