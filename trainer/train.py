"""The training loop: `python -m trainer --config runs/RUN/config.yaml`.

`train(cfg, run_dir)` reads top to bottom: processes and mesh, data, model,
optimizer, checkpoint resume, then the steps (forward/backward, clip, step,
log, evaluate, checkpoint, stop on a signal). The run directory is the config
file's directory; metrics.jsonl, checkpoints/ and profiler/ go there.

Non-finite numbers are never trained on nor saved: a step whose loss or
gradient norm is not finite on any rank skips its optimizer update (logged,
and counted as `skipped_steps` in metrics.jsonl); `train.max_nonfinite_steps`
of them in a row stop the run. A checkpoint that would hold a non-finite
value is refused, and an interval save that falls inside a run of skipped
steps waits for the next good step, so such steps never rotate good
checkpoints out.

Exit status of `python -m trainer`: 0 done; 2 bad config or input (one
`error:` line); 3 (NONFINITE_EXIT) stopped on non-finite numbers, with the
latest checkpoint left as the last good one; 75 (EX_TEMPFAIL) stopped by a
signal or the stop file after saving, to be requeued.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from trainer.config import REQUEUE_EXIT, STOP_FILE, ConfigError, TrainerConfig, load_trainer_config
from trainer.metrics import MetricsLogger, StepProfiler, setup_logging
from trainer.model import num_flops_per_token, select_attention
from trainer.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from trainer.parallel import (Batch, ParallelDims, Runner, build_model, build_runner, distributed_session,
                              global_mean, resolve_dtype)
from trainer.checkpoint import Checkpointer, ModelState, NonFiniteError, OptimizerState, RNGState

log = logging.getLogger(__name__)

EX_TEMPFAIL = REQUEUE_EXIT  # "requeue me": stopped by a signal after saving a checkpoint
NONFINITE_EXIT = 3  # stopped on non-finite numbers (see the module docstring)


class Sampler(Protocol):
    def next_batch(self) -> Batch: ...  # (inputs_BT, targets_BT), [micro_batch_size, seq_len] int64

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


# build_data(cfg, run_dir, dp_rank, dp_size) -> (train, val or None, tokenizer vocab size)
DataBuilder = Callable[[TrainerConfig, Path, int, int], tuple[Sampler, Optional[Sampler], int]]


@dataclass
class TrainResult:
    step: int  # the last completed optimizer step
    loss: Optional[float]  # the last logged training loss (mean over dp ranks)
    requeue: bool  # stopped early by SIGUSR1/SIGTERM; exit EX_TEMPFAIL


def train(cfg: TrainerConfig, run_dir: Path, data: Optional[DataBuilder] = None) -> TrainResult:
    run_dir = Path(run_dir)
    with distributed_session() as env:
        setup_logging(cfg.logging.level, env.rank)
        dims = ParallelDims.from_config(cfg.parallel, env.world_size)
        dims.build_mesh(env.device.type)
        dtype = resolve_dtype(cfg.train.dtype, env.device)
        attn_impl = select_attention(cfg.model, env.device, dtype)  # a config error: before the data work
        torch.manual_seed(cfg.run.seed)
        accum = cfg.train.grad_accum_steps
        tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len * accum * dims.dp
        log.info("world %d = pp %d x dp %d x tp %d on %s (%s), %s, attention %s; global batch = micro_batch_size(%d) "
                 "x grad_accum_steps(%d) x dp(%d) windows of %d = %d tokens", env.world_size, dims.pp, dims.dp, dims.tp,
                 env.device, dist.get_backend() if dist.is_initialized() else "no process group", dtype, attn_impl,
                 cfg.train.micro_batch_size, accum, dims.dp, cfg.data.seq_len, tokens_per_step)

        train_data, val_data, vocab_size = (data or _default_data())(cfg, run_dir, dims.dp_rank, dims.dp)
        if vocab_size > cfg.model.vocab_size:
            raise ConfigError("model.vocab_size", f"the tokenizer has {vocab_size} tokens but model.vocab_size is "
                              f"{cfg.model.vocab_size}: set model.vocab_size >= {vocab_size}")
        model = build_model(cfg, dims, env.device, dtype, attn_impl)
        runner = build_runner(model, dims, cfg, env.device, dtype)
        optimizer = build_optimizer(model, cfg.train, env.device)
        lr_scheduler = build_lr_scheduler(optimizer, cfg.train)
        state = TrainState()
        # What a checkpoint holds; model and optimizer under full-model names, so any
        # dp/tp/pp layout can load what another saved.
        states = {"model": ModelState([model]), "optimizer": OptimizerState([model], [optimizer]),
                  "lr_scheduler": lr_scheduler, "data": train_data, "train_state": state, "rng": RNGState()}
        checkpointer = Checkpointer(run_dir / cfg.checkpoint.dir, cfg.checkpoint)
        state.step = checkpointer.load_latest(states)
        if state.step >= cfg.train.steps and env.rank == 0:
            log.warning("this run already reached train.steps=%d (checkpoint at step %d): nothing to train; "
                        "raise train.steps (with --force) or pick another --run-name", cfg.train.steps, state.step)
        elif state.step and state.step < cfg.train.steps:
            log.info("resumed from step %d of %s", state.step, run_dir / cfg.checkpoint.dir)
        elif cfg.checkpoint.save_initial:
            checkpointer.save(0, states)
        metrics = MetricsLogger(cfg, run_dir, env.rank, env.world_size, env.device,
                                num_flops_per_token(cfg.model, cfg.data.seq_len))
        # Steps after state.step that an earlier attempt logged are superseded from here on.
        metrics.log_restart(state.step, dict(dp=dims.dp, tp=dims.tp, pp=dims.pp))
        profiler = StepProfiler(cfg.logging, run_dir, env.rank)
        stop = StopSignal(run_dir / STOP_FILE)
        evaluating = val_data is not None and cfg.train.eval_interval > 0 and runner.can_eval
        if val_data is not None and cfg.train.eval_interval > 0 and not runner.can_eval:
            log.warning("evaluation off: this torch has no forward-only pipeline schedule (torch >= 2.9 has)")
        val_start = copy.deepcopy(val_data.state_dict()) if val_data is not None else None
        result = TrainResult(state.step, None, requeue=False)
        window_start, window_steps, data_s = time.perf_counter(), 0, 0.0
        save_due = False
        try:
            while state.step < cfg.train.steps:
                state.step += 1
                profiler.begin(state.step)
                t0 = time.perf_counter()
                batches = _next_batches(train_data, accum, env.device)
                data_s += time.perf_counter() - t0
                loss = runner.train_step(batches)
                grad_norm = clip_grad_norm_(model.parameters(), cfg.train.grad_clip, dims.pp_group)
                lr = lr_scheduler.get_last_lr()[0]
                # The step's one host sync: every rank learns whether any rank saw a stop
                # request or a non-finite loss or gradient norm, before the update.
                stopping, nonfinite = agree(stop.requested(), ~(torch.isfinite(loss) & torch.isfinite(grad_norm)))
                if nonfinite:  # no update; the schedule moves on with the step count
                    state.skipped_steps += 1
                    state.nonfinite_streak += 1
                    with warnings.catch_warnings():  # a skipped first step is not the misuse torch warns of
                        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
                        lr_scheduler.step()
                else:
                    optimizer.step()
                    lr_scheduler.step()
                    state.nonfinite_streak = 0
                optimizer.zero_grad(set_to_none=True)
                profiler.end(state.step)
                window_steps += 1

                last = state.step == cfg.train.steps
                if nonfinite:
                    _skipped(state, cfg, metrics, global_mean(loss, dims), grad_norm.item())
                if state.step % cfg.logging.interval == 0 or last:
                    result.loss = global_mean(loss, dims)  # also waits for the device: the timing is honest
                    elapsed = time.perf_counter() - window_start
                    metrics.log_train(state.step, result.loss, lr, grad_norm.item(), tokens_per_step * window_steps,
                                      elapsed, window_steps, data_s, skipped_steps=state.skipped_steps)
                    window_start, window_steps, data_s = time.perf_counter(), 0, 0.0
                t_aside = time.perf_counter()  # evaluation and saving are not training time
                if evaluating and state.step % cfg.train.eval_interval == 0:
                    metrics.log_eval(state.step, evaluate(runner, val_data, val_start, cfg, dims, env.device))
                result.step, result.requeue = state.step, stopping and not last
                save_due = save_due or state.step % cfg.checkpoint.interval == 0
                if last or result.requeue or (save_due and not nonfinite):
                    checkpointer.save(state.step, states, final=last)  # refuses non-finite values
                    save_due = False
                elif save_due and state.nonfinite_streak == 1 and env.rank == 0:
                    log.warning("step %d: checkpoint deferred to the next step with a finite loss and gradient "
                                "norm", state.step)
                window_start += time.perf_counter() - t_aside
                if result.requeue:
                    log.warning("stopping after step %d on %s: exit %d to be requeued", state.step,
                                stop.received or "a signal on another rank", EX_TEMPFAIL)
                    break
        finally:
            stop.restore()
            profiler.close()
            metrics.close()
            checkpointer.close()
        return result


def agree(stop_requested: bool, nonfinite: torch.Tensor) -> tuple[bool, bool]:
    """(any rank asked to stop, any rank has a non-finite loss or gradient norm): one
    all-reduce (max) of both flags and one host sync, so all ranks take the same branch."""
    flags = torch.stack([nonfinite.new_full((), float(stop_requested), dtype=torch.float32), nonfinite.float()])
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    stop, bad = flags.tolist()
    return bool(stop), bool(bad)


def _skipped(state: "TrainState", cfg: TrainerConfig, metrics: MetricsLogger, loss: float, grad_norm: float) -> None:
    """Report a skipped step; stop the run when max_nonfinite_steps have come in a row."""
    limit = cfg.train.max_nonfinite_steps
    if metrics.enabled:  # rank 0
        log.warning("step %d: loss %s, gradient norm %s: not finite, optimizer update skipped (%d in a row, the run "
                    "stops at %d)", state.step, loss, grad_norm, state.nonfinite_streak, limit)
    metrics.log_nonfinite(state.step, loss, grad_norm, state.nonfinite_streak, state.skipped_steps)
    if state.nonfinite_streak >= limit:
        good = state.step - state.nonfinite_streak
        raise NonFiniteError(f"{state.nonfinite_streak} steps in a row (to step {state.step}) had a non-finite loss "
                             f"or gradient norm (train.max_nonfinite_steps={limit}); the weights are those of step "
                             f"{good} and no checkpoint was written since: lower train.lr (now {cfg.train.lr:g}) or "
                             "raise train.warmup_steps, check the data, then resume from the latest checkpoint")


def evaluate(runner: Runner, val_data: Sampler, val_start: dict, cfg: TrainerConfig, dims: ParallelDims,
             device: torch.device) -> float:
    """Mean loss over eval_batches global batches, the same ones every time."""
    val_data.load_state_dict(copy.deepcopy(val_start))
    total = torch.zeros((), device=device)
    for _ in range(cfg.train.eval_batches):
        total += runner.eval_step(_next_batches(val_data, cfg.train.grad_accum_steps, device))
    return global_mean(total / cfg.train.eval_batches, dims)


def _next_batches(sampler: Sampler, n: int, device: torch.device) -> list[Batch]:
    batches = [sampler.next_batch() for _ in range(n)]
    return [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches]


class TrainState:
    """The step count (the same on every rank), the steps skipped as non-finite, and
    how many of the latest steps in a row were."""

    def __init__(self):
        self.step = 0
        self.skipped_steps = 0
        self.nonfinite_streak = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "skipped_steps": self.skipped_steps, "nonfinite_streak": self.nonfinite_streak}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = int(state_dict["step"])
        # Checkpoints from before non-finite steps were counted lack these.
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.nonfinite_streak = int(state_dict.get("nonfinite_streak", 0))


class StopSignal:
    """SIGUSR1 (Slurm's warning before the time limit), SIGTERM (preemption,
    scancel), or the batch script's stop file (torchrun does not pass SIGUSR1
    on to its workers): finish the step, save, exit EX_TEMPFAIL. The handler
    only sets a flag; ranks agree on it every step (`agree`) so that all stop
    on the same step, whichever of them saw it."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, stop_file: Path):
        self.received: Optional[str] = None
        self.stop_file = stop_file
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        """Whether this rank saw a signal or the stop file (`agree` tells it about the others)."""
        if self.received is None and self.stop_file.exists():
            self.received = f"the stop file {self.stop_file.name}"
        return self.received is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _default_data() -> DataBuilder:
    from trainer.data import build_data

    return build_data


def main(argv: Optional[list[str]] = None, data: Optional[DataBuilder] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer", description="Train the Llama decoder of a run.",
        epilog=f"exit status: 0 done; 2 bad config or input; {NONFINITE_EXIT} stopped on non-finite numbers "
               f"(train.max_nonfinite_steps); {EX_TEMPFAIL} stopped by a signal or the stop file after saving")
    parser.add_argument("--config", required=True, type=Path, help="runs/RUN/config.yaml (its folder is the run)")
    args = parser.parse_args(argv)
    try:
        cfg = load_trainer_config(args.config)
        result = train(cfg, args.config.resolve().parent, data=data)
    except (ConfigError, NonFiniteError) as exc:
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":  # one line, not one per rank
            print(f"error: {exc}", file=sys.stderr)
        return NONFINITE_EXIT if isinstance(exc, NonFiniteError) else 2
    return EX_TEMPFAIL if result.requeue else 0
