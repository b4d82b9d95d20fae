"""The training loop's parts (trainer/train.py): the batches of the next step read ahead,
Python's garbage collector on a schedule, the step count a checkpoint holds, the stop
request (a signal or the stop file) that all ranks agree on, and the marker that tells the
hang watchdog when the device has finished a step."""

from __future__ import annotations

import copy
import gc
import signal
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from trainer.parallel import Batch


def step_marker(device: torch.device) -> Optional[torch.cuda.Event]:
    """What the device reaches once the work queued so far is done, for the hang watchdog to ask
    without blocking: a CUDA event; None on the CPU, where a step is done when its call returns."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class Sampler(Protocol):
    def next_batch(self) -> Batch: ...  # (inputs_BT, targets_BT), [micro_batch_size, seq_len] int64

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


def next_batches(sampler: Sampler, n: int, device: torch.device, pin: bool = False) -> list[Batch]:
    """n micro batches on `device`. Pinned first (CUDA), the copies do not block the host:
    from pageable memory non_blocking=True is a synchronous copy."""
    batches = [sampler.next_batch() for _ in range(n)]
    if pin:
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
    return [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches]


class BatchFeeder:
    """One step's micro batches at a time, the next step's read ahead (train.prefetch) while this one
    runs. In checkpoints it stands for the sampler: its state is the position after the batches handed
    out, not those read ahead, so a resumed run trains on the same batches."""

    def __init__(self, sampler: Sampler, n: int, device: torch.device, read_ahead: bool = True):
        self.sampler, self.n, self.device = sampler, n, device
        self.read_ahead = read_ahead
        self.pin = device.type == "cuda"
        self._ahead: Optional[list[Batch]] = None
        self._state: Optional[dict] = None  # the sampler's state before _ahead was read

    def next(self, read_ahead: bool = True) -> list[Batch]:
        batches = self._ahead if self._ahead is not None else self._read()
        self._ahead, self._state = None, None
        if self.read_ahead and read_ahead:
            self._state = copy.deepcopy(self.sampler.state_dict())
            self._ahead = self._read()
        return batches

    def _read(self) -> list[Batch]:
        return next_batches(self.sampler, self.n, self.device, self.pin)

    def state_dict(self) -> dict:
        return self._state if self._ahead is not None else self.sampler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.sampler.load_state_dict(state_dict)
        self._ahead, self._state = None, None


class GarbageCollection:
    """The cyclic collector off, a young-generation collection every `interval` steps instead (train.gc_interval)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.was_enabled = gc.isenabled()
        if interval:
            gc.disable()
            gc.collect(1)

    def step(self, step: int) -> None:
        if self.interval and step % self.interval == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.interval and self.was_enabled:
            gc.enable()


@dataclass
class TrainState:
    """The step count (the same on every rank), the steps skipped as non-finite, the latest streak."""

    step: int = 0
    skipped_steps: int = 0
    nonfinite_streak: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = int(state_dict["step"])
        # Checkpoints from before non-finite steps were counted lack these.
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.nonfinite_streak = int(state_dict.get("nonfinite_streak", 0))


class StopSignal:
    """SIGUSR1 (Slurm's warning before the time limit), SIGTERM (preemption, scancel), SIGINT (Ctrl-C,
    forwarded by `slipway local`), or the batch script's stop file (torchrun does not pass SIGUSR1 on
    to its workers): finish the step, save, exit EX_TEMPFAIL. The handler only sets a flag (`StopVote`
    shares it). Only `watch_file` ranks look for the file: one stat a sync step, not one per rank. A
    second SIGINT past AGAIN_SECONDS after the first (torchrun at a terminal passes the terminal's own
    on at once) stops at once: KeyboardInterrupt."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
    AGAIN_SECONDS = 1.0

    def __init__(self, stop_file: Path, watch_file: bool = True):
        self.received: Optional[str] = None
        self.stop_file = stop_file
        self.watch_file = watch_file
        self._interrupted: Optional[float] = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._interrupted is not None and now - self._interrupted > self.AGAIN_SECONDS:
                raise KeyboardInterrupt
            self._interrupted = self._interrupted or now
        self.received = self.received or signal.Signals(signum).name

    def requested(self) -> bool:
        """Whether this rank saw a signal or the stop file (`StopVote` tells it about the others)."""
        if self.received is None and self.watch_file and self.stop_file.exists():
            self.received = f"the stop file {self.stop_file.name}"
        return self.received is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class StopVote:
    """Whether any rank asked to stop, agreed without touching the device: a gloo all-reduce (max) of the
    flags, started at a sync step's beginning and read at its end; a later request counts at the next sync."""

    def __init__(self, timeout: Optional[timedelta] = None):
        # Its own group: the default one may be NCCL (device tensors, a stream to wait on), and
        # on CPU runs these small votes should not queue behind the gradient collectives.
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self._flag = torch.zeros(1)
        self._work = None

    def start(self, requested: bool) -> None:
        self._flag = torch.full((1,), float(requested))
        if self.group is not None:
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def result(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return bool(self._flag[0])
