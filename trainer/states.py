"""What a checkpoint holds, as state objects the Checkpointer (trainer/checkpoint.py) saves
and loads: the model and the optimizer under full-model names, whatever the parallel layout,
and each rank's random streams beside the shards."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class ModelState:
    """The model's parameters under full-model names, whatever the parallel layout. A pipeline
    stage holds some of the names; loading sets those it has (strict=False: a stage lacks the
    other stages' layers; DCP itself fails on a name the checkpoint lacks)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=False))


class OptimizerState:
    """Optimizer state under full-model parameter names (`state.<fqn>.exp_avg`), so it reshards like the model."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        fresh = not self.optimizer.state
        sd = get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIONS)
        if fresh:
            # DCP materialises an empty Adam state by one step with zero grads and lr 0,
            # which leaves `step` at 1 and would shift bias correction after a
            # save_initial; put the counter back to where a fresh optimizer starts.
            for state in self.optimizer.state.values():
                state["step"].zero_()  # AdamW keeps its step count as a tensor
            sd = get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIONS)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self._OPTIONS)


class RNGState:
    """This rank's random streams (Python, numpy, torch CPU, the current CUDA device's), saved to the
    rank's own file beside the shards (`rank_local`), so each rank gets exactly its own back."""

    rank_local = True

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(),
                                 "numpy": np.random.get_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(state_dict["python"])
        torch.set_rng_state(state_dict["torch"])
        if "numpy" in state_dict:  # absent from a checkpoint of a trainer that ran without numpy
            np.random.set_state(state_dict["numpy"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


def local_tensors(state: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every non-empty tensor in a (nested) state dict, this rank's shards only."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, name: str) -> None:
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            if value.numel():
                tensors.append((name, value))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{name}.{key}" if name else str(key))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{name}.{i}")

    walk(state, prefix)
    return tensors


def nonfinite_names(state: Any, prefix: str = "") -> list[str]:
    """This rank's floating-point tensors (nested) that hold a NaN or an inf: one host sync per device."""
    tensors = [(name, t) for name, t in local_tensors(state, prefix) if t.is_floating_point()]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in tensors:
        by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    if all(bool(torch.stack(flags).all()) for flags in by_device.values()):
        return []
    return [name for name, t in tensors if not bool(torch.isfinite(t).all())]
