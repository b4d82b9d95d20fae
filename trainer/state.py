"""What a checkpoint holds, as Stateful objects (state_dict / load_state_dict).

`build_states` gives the dict the Checkpointer saves and loads:

    model         parameters under their full-model names (any dp/tp/pp layout)
    optimizer     AdamW state, flattened per parameter name (layout-independent)
    lr_scheduler  the LambdaLR itself
    data          the train sampler; its state must be the same on every rank
                  (a global position), as torch.distributed.checkpoint keeps
                  one copy of a non-tensor value that several ranks save
    train_state   the step and this rank's RNG streams; `rank_local = True`
                  asks the Checkpointer for a per-rank file beside the shards

Model and optimizer go through torch.distributed.checkpoint.state_dict, which
handles FSDP2/TP DTensors, DDP's `module.` prefix, and pipeline stages holding
a subset of the names.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ModelState:
    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState:
    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        fresh = not self.optimizer.state
        state = get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIONS)
        if fresh:
            # get_optimizer_state_dict materialises empty AdamW state with one lr-0 step,
            # leaving `step` at 1 (bias correction would be off after save_initial): undo it.
            for param_state in self.optimizer.state.values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"].zero_()
            state = get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIONS)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self._OPTIONS)


class TrainState:
    """The optimizer step count and this rank's random number generators.
    Rank-local: the Checkpointer writes it to this rank's own file."""

    rank_local = True

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step, "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


def build_states(model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any, train_data: Stateful,
                 train_state: TrainState) -> dict[str, Stateful]:
    return {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optimizer),
        "lr_scheduler": lr_scheduler,
        "data": train_data,
        "train_state": train_state,
    }
