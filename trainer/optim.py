"""AdamW, the learning-rate schedule, and gradient clipping across all shards."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config import TrainSection


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on the 1-D norms), in groups split by DTensor-ness: a fused
    kernel cannot mix DTensor and plain tensors (tensor parallel leaves norms plain without sequence parallel)."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = defaultdict(list)
    for param in model.parameters():  # shared (tied) parameters appear once
        if param.requires_grad:
            groups[(param.dim() >= 2, isinstance(param, DTensor))].append(param)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0}
            for (decay, _), params in sorted(groups.items())]


def build_optimizer(model: nn.Module, cfg: TrainSection) -> torch.optim.Optimizer:
    """Fused AdamW (CPU too since torch 2.4, plain and DTensor fp32 parameters alike): one kernel per
    parameter group, and the `found_inf` input `SkippableStep` skips with, the host never looking."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), fused=True, lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


class SkippableStep:
    """optimizer.step(), skipped on the device where a number was not finite on any rank: fused AdamW
    takes a `found_inf` tensor (as torch.amp's GradScaler passes it) and, at 1, changes no parameter,
    moment or step count. After `limit` skips in a row every update is skipped, so the weights stay
    the last good step's until the host's next sync sees the streak and stops the run."""

    def __init__(self, optimizer: torch.optim.Optimizer, limit: int, streak: int, device: torch.device):
        self.optimizer = optimizer
        self.limit = limit
        self.streak = torch.full((), float(streak), device=device)  # a fill, not a host-to-device copy

    def step(self, bad: torch.Tensor) -> torch.Tensor:
        """Update unless `bad` (1.0) or the streak reached the limit; returns the skip flag (1.0 skipped)."""
        skip = torch.maximum(bad, (self.streak >= self.limit).float())
        self.streak = (self.streak + skip) * skip
        self.optimizer.found_inf = skip
        self.optimizer.step()
        return skip


def lr_at(step: int, cfg: TrainSection, start: Optional[tuple[int, float]] = None) -> float:
    """The learning rate of optimizer step `step` (1-based): linear warm-up over warmup_steps,
    then decay (cosine, linear or constant) to min_lr at `steps`, from `start` (step, rate): the
    warm-up's end at lr, or where a train-on took over (`Schedule`)."""
    if start is None:
        if cfg.warmup_steps > 0 and step <= cfg.warmup_steps:
            return cfg.lr * step / cfg.warmup_steps
        start = (cfg.warmup_steps, cfg.lr)
    first, rate = start
    if cfg.decay == "constant" or (first > cfg.warmup_steps and cfg.train_on == "constant"):
        return rate
    progress = min(1.0, (step - first) / max(1, cfg.steps - first))
    shape = 1.0 - progress if cfg.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (rate - cfg.min_lr) * shape


class Schedule:
    """The learning rate step by step (`lr_at`); Stateful. A checkpoint resumed under another train.steps
    goes on as train.train_on says (within the warm-up, which does not depend on it, nothing changes)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainSection):
        self.optimizer, self.cfg = optimizer, cfg
        self.last_epoch = 0  # the steps done (LambdaLR's name: the checkpoints it wrote hold it)
        self.steps = cfg.steps  # the train.steps the plan decays to
        self.start: Optional[tuple[int, float]] = None  # where a train-on took over, and its rate
        self.said = ""  # a train-on's plan, for the log
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.last_epoch + 1, self.cfg, self.start)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict:
        reached = lr_at(self.last_epoch, self.cfg, self.start) if self.last_epoch else 0.0
        first, rate = self.start or (-1, 0.0)
        return {"last_epoch": self.last_epoch, "steps": self.steps, "start_step": first, "start_lr": rate,
                "lr": reached}

    def load_state_dict(self, state: dict) -> None:
        # A checkpoint written before train-ons were planned holds last_epoch alone: the plan stays.
        self.last_epoch, steps = int(state["last_epoch"]), int(state.get("steps", self.cfg.steps))
        self.start = (int(state["start_step"]), float(state["start_lr"])) if state.get("start_step", -1) >= 0 else None
        if steps != self.cfg.steps and self.last_epoch > self.cfg.warmup_steps:
            self.start = (self.last_epoch, float(state["lr"]))
            constant = self.cfg.train_on == "constant" or self.cfg.decay == "constant"
            self.said = (f"train.steps {steps} -> {self.cfg.steps} at step {self.last_epoch}: the learning rate goes on "
                         f"from {self.start[1]:.2e}, " + ("constant to the end" if constant else
                                                          f"decaying ({self.cfg.decay}) to {self.cfg.min_lr:.2e} at step "
                                                          f"{self.cfg.steps}") + " (train.train_on)")
        self.steps = self.cfg.steps
        self._apply()


def _sharded_norm_sq(grads: list[DTensor]) -> torch.Tensor:
    """The squared L2 norm of DTensor gradients of one mesh and placements: each norm (partial over the
    mesh dimensions it is sharded on) squared and summed here, then over each partial dimension in mesh
    order. `get_total_norm` and `full_tensor()` reach the same number but log on every rank, every run,
    that two collectives on a dp x tp mesh could be one over a flattened mesh (for one scalar a step)."""
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    placements = norms[0].placements
    if not all(getattr(p, "norm_type", None) == 2.0 for p in placements if p.is_partial()):
        return torch.stack([n.full_tensor().float() for n in norms]).pow(2).sum()
    sq = torch.stack([n.to_local().float() for n in norms]).pow(2).sum()
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=norms[0].device_mesh.get_group(dim))
    return sq


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float,
                    pp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Clip gradients to a global L2 norm (max_norm 0 only measures it) and return the norm, the same
    on every rank and layout. DTensor gradients go by mesh and placements (`_sharded_norm_sq`); plain
    ones are whole; pipeline stages' squared norms are summed over the pp group (as torchtitan)."""
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else None
        groups[key].append(grad)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for group in groups.values():
        if isinstance(group[0], DTensor):
            total_sq = total_sq + _sharded_norm_sq(group).to(device)
        else:
            total_sq = total_sq + torch.nn.utils.get_total_norm(group, norm_type=2.0).float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        torch._foreach_mul_(local, coef.to(local[0].device))
    return total
