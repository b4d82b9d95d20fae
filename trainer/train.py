"""The training loop: `python -m trainer --config runs/RUN/config.yaml` (the run directory is the
config file's). `train` reads top to bottom, in torchtitan's shape: `set_up`, then `train_step` on
every step and `sync_step` on sync steps.

The host waits for the device only on a sync step: a logged one (`logging.interval`, each attempt's
first, the last), one with a checkpoint due, or one on which the run stops. There it reads what every
step since the last sync reported (loss averaged over ranks, gradient norm, skipped) in one copy. Stop
requests travel on the host, in a gloo all-reduce started at a sync step's beginning and read at its
end: all ranks stop after the same step, and no step costs more as ranks are added.

Non-finite numbers are never trained on nor saved: a step whose loss or gradient norm is not finite
on any rank skips its update, decided on the device (`trainer.optim.SkippableStep`), and is counted at
the next sync; `train.max_nonfinite_steps` in a row stop the run. An interval save that falls inside
a run of skipped steps waits for the next good step, so they never rotate good checkpoints out.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from common.edge import Parser, run_at_edge
from common.errors import ConfigError
from common.layouts import checkpoint_bytes, layout_advice, memory_report, num_flops_per_token, resolve_reshard
from common.rundir import (BAD_INPUT_EXIT, FAILED_EXIT, HANG_EXIT, NONFINITE_EXIT, REQUEUE_EXIT, RunDir,
                           check_code)
from trainer.checkpoint import Checkpointer, CheckpointWriteError, NonFiniteError, resolve_async_save
from trainer.compute import check_float8, compile_error, graph_break_report, reset_graph_breaks
from trainer.config import TrainerConfig, load_trainer_config
from trainer.loop import (BatchFeeder, GarbageCollection, Sampler, StopSignal, StopVote, TrainState, next_batches,
                          step_marker)
from trainer.metrics import MetricsLogger, StepProfiler, setup_logging
from trainer.model import select_attention
from trainer.optim import Schedule, SkippableStep, build_optimizer, clip_grad_norm_
from trainer.parallel import (Batch, DistEnv, ParallelDims, build_model, distributed_session, global_mean, resolve_dtype,
                              step_stats)
from trainer.preflight import AllReduceGate
from trainer.runners import Runner, build_runner
from trainer.states import ModelState, OptimizerState, RNGState
from trainer.watchdog import HangWatchdog, collective_timeout

log = logging.getLogger(__name__)


# The torch releases CI tests (the oldest and newest ends: `make test-oldest`, `make test`),
# the same range as pyproject's `trainer` extra and the Makefile's TORCH_SPEC.
SUPPORTED_TORCH = ((2, 10), (2, 13))


def unsupported_torch(version: str) -> Optional[str]:
    """A one-line warning when torch `version` (torch.__version__: 2.13.0+cpu, NGC's 2.10.0a0+...)
    is outside SUPPORTED_TORCH; None inside it, or when the version cannot be read."""
    match = re.match(r"(\d+)\.(\d+)", version)
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TORCH
    if match is None or (lo_major, lo_minor) <= (int(match[1]), int(match[2])) <= (hi_major, hi_minor):
        return None
    return (f"torch {version} is outside the supported range {lo_major}.{lo_minor} to {hi_major}.{hi_minor} (the "
            f"releases tested): install torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1} if this run "
            "misbehaves")


# build_data(cfg, run_dir, dp_rank, dp_size) -> (train, val or None, tokenizer vocab size)
DataBuilder = Callable[[TrainerConfig, Path, int, int], tuple[Sampler, Optional[Sampler], int]]


def train(cfg: TrainerConfig, run_dir: Path, data: Optional[DataBuilder] = None) -> bool:
    """Train `cfg` to its last step; True where a signal or the stop file stopped it early, saved
    (exit REQUEUE_EXIT)."""
    run_dir = Path(run_dir)
    timeout = collective_timeout(cfg.train)  # longer than the hang watchdog's limits: it speaks first
    # The batch script's preflight all-reduce, first in this process group (trainer/preflight.py):
    # bounded from before the group forms, and over before any data or model work.
    gate = AllReduceGate.from_environ()
    if gate is not None:
        gate.arm()
    with distributed_session(timeout) as env, contextlib.ExitStack() as closing:
        if gate is not None:
            gate.check(env.device)
        if data is None:
            from trainer.data import build_data as data
        training = set_up(cfg, run_dir, env, timeout, data, closing)
        state, loop = training.state, Loop(first_step=training.state.step + 1)
        while state.step < cfg.train.steps:
            state.step += 1
            last = state.step == cfg.train.steps
            training.profiler.begin(state.step)
            # Whether this is a sync step is known up front and the same on every rank.
            loop.save_due = loop.save_due or state.step % cfg.checkpoint.interval == 0
            sync = (loop.save_due or state.step % cfg.logging.interval == 0 or last or state.step == loop.first_step)
            if sync:
                training.vote.start(training.stop.requested())  # read at the end of the step: by then it is long done
            t0 = time.perf_counter()
            batches = training.feeder.next(read_ahead=not last)
            loop.data_s += time.perf_counter() - t0
            loop.pending.append(train_step(training, batches))
            training.profiler.end(state.step)
            training.collector.step(state.step)
            loop.window_steps += 1
            stopping = training.vote.result() if sync else False
            training.watchdog.step_queued(state.step, step_marker(env.device))  # done once the device gets there
            if cfg.train.compile and state.step == loop.first_step and env.rank == 0:
                log.info("%s", graph_break_report())
            if sync and sync_step(training, loop, last, stopping):
                return True
        return False


@dataclass(kw_only=True)
class Training:
    """What `set_up` builds for the loop (its helpers closed by the set-up's ExitStack)."""

    cfg: TrainerConfig
    env: DistEnv
    dims: ParallelDims
    tokens_per_step: int
    model: nn.Module
    runner: Runner
    optimizer: torch.optim.Optimizer
    lr_scheduler: Schedule
    update: SkippableStep
    feeder: BatchFeeder
    val_data: Optional[Sampler]
    val_start: Optional[dict]
    state: TrainState
    states: dict
    checkpointer: Checkpointer
    metrics: MetricsLogger
    profiler: StepProfiler
    stop: StopSignal
    vote: StopVote
    collector: GarbageCollection
    watchdog: HangWatchdog


@dataclass
class Loop:
    """The loop's bookkeeping between sync steps."""

    first_step: int  # this attempt's warm-up (compile, first allocations): not in tokens/s
    pending: list[tuple[int, float, torch.Tensor]] = field(default_factory=list)  # (step, lr, stats) on the device
    save_due: bool = False  # an interval save waits for a step with finite numbers
    window_start: float = field(default_factory=time.perf_counter)
    window_steps: int = 0
    data_s: float = 0.0
    step_s: float = 0.0  # the mean step time of the last window logged, for the saves' records


def train_step(training: Training, batches: list[Batch]) -> tuple[int, float, torch.Tensor]:
    """One optimizer step, queued without waiting for the device: (step, lr, [loss, grad norm, skipped])."""
    with _compile_errors(training.cfg.train.compile):
        loss = training.runner.forward_backward(batches)
    grad_norm = clip_grad_norm_(training.model.parameters(), training.cfg.train.grad_clip, training.dims.pp_group)
    lr = training.lr_scheduler.get_last_lr()[0]
    stats = step_stats(loss, grad_norm, training.dims)  # on the device: loss, norm, non-finite
    skipped = training.update.step(stats[2])
    training.lr_scheduler.step()  # the schedule moves on with the step count, skipped or not
    training.optimizer.zero_grad(set_to_none=True)
    return training.state.step, lr, torch.cat([stats[:2], skipped[None]])


def sync_step(training: Training, loop: Loop, last: bool, stopping: bool) -> bool:
    """Read the steps since the last sync, log, evaluate and save when due; True when the run stops here."""
    cfg, state = training.cfg, training.state
    logging_due = state.step % cfg.logging.interval == 0 or last or stopping or state.step == loop.first_step
    nonfinite, loss, grad_norm = _replay(loop.pending, state, cfg, training.metrics)
    training.watchdog.step_done(state.step)  # the host has waited for the device: done, whatever the markers say
    lr = loop.pending[-1][1]
    loop.pending.clear()
    if logging_due:
        elapsed = time.perf_counter() - loop.window_start
        warmup = state.step == loop.first_step  # a window of that one step: warm-up time, no throughput
        training.metrics.log_train(state.step, loss, lr, grad_norm, training.tokens_per_step * loop.window_steps,
                                   elapsed, loop.window_steps, loop.data_s, skipped_steps=state.skipped_steps,
                                   warmup_s=elapsed if warmup else None)
        if not warmup:
            loop.step_s = elapsed / loop.window_steps
        loop.window_start, loop.window_steps, loop.data_s = time.perf_counter(), 0, 0.0
    t_aside = time.perf_counter()  # evaluation and saving are not training time
    if training.val_data is not None and cfg.train.eval_interval and state.step % cfg.train.eval_interval == 0:
        with _compile_errors(cfg.train.compile):
            training.metrics.log_eval(state.step, evaluate(training.runner, training.val_data, training.val_start, cfg,
                                                           training.dims, training.env.device))
    requeue = stopping and not last
    if last or requeue or (loop.save_due and not nonfinite):
        training.checkpointer.save(state.step, training.states, final=last, step_s=loop.step_s)  # refuses non-finite values
        loop.save_due = False
    elif loop.save_due and state.nonfinite_streak == 1 and training.env.rank == 0:
        log.warning("step %d: checkpoint deferred to the next step with a finite loss and gradient norm", state.step)
    loop.window_start += time.perf_counter() - t_aside
    if requeue:
        log.warning("stopping after step %d on %s: saved, exit %d (resumable: a job is requeued, a launch "
                    "started again resumes)", state.step, training.stop.received or "a request seen by another rank",
                    REQUEUE_EXIT)
    return requeue


def set_up(cfg: TrainerConfig, run_dir: Path, env: DistEnv, timeout: timedelta, data: DataBuilder,
           closing: contextlib.ExitStack) -> Training:
    """Every config error before the data work; every helper's close on `closing`."""
    setup_logging(cfg.logging.level, env.rank)
    # From here a stop request waits for the first step, which saves it (the first step syncs).
    stop = StopSignal(RunDir(run_dir).stop_file, watch_file=env.rank == 0)
    closing.callback(stop.restore)
    dims = ParallelDims.from_config(cfg.parallel, env.world_size)
    dims.build_mesh(env.device.type, timeout)
    dtype = resolve_dtype(cfg.train.dtype, env.device)
    attn_impl = select_attention(cfg.model, env.device, dtype)  # config errors: before the data work
    check_float8(cfg.train, env.device)
    torch.manual_seed(cfg.run.seed)
    tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len * cfg.train.grad_accum_steps * dims.dp
    _describe(cfg, env, dims, dtype, attn_impl, timeout, tokens_per_step)

    train_data, val_data, _ = data(cfg, run_dir, dims.dp_rank, dims.dp)
    feeder = BatchFeeder(train_data, cfg.train.grad_accum_steps, env.device, read_ahead=cfg.train.prefetch)
    model = build_model(cfg, dims, env.device, dtype, attn_impl)
    runner = build_runner(model, dims, cfg, env.device, dtype)
    optimizer = build_optimizer(model, cfg.train)
    lr_scheduler = Schedule(optimizer, cfg.train)
    state = TrainState()
    # What a checkpoint holds (trainer/states.py: any dp/tp/pp layout loads what another saved).
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
              "lr_scheduler": lr_scheduler, "data": feeder, "train_state": state, "rng": RNGState()}
    # The hang watchdog (trainer/watchdog.py) from here on: the load is checkpoint work, bounded by its own limit.
    watchdog = HangWatchdog(cfg.train, run_dir, env.rank).start(0)
    closing.callback(watchdog.stop)  # last: it guards the wait for a save in flight too
    checkpointer = _resume(cfg, run_dir, env, timeout, states, watchdog)
    closing.callback(checkpointer.close)
    metrics = closing.enter_context(contextlib.closing(MetricsLogger(
        cfg, run_dir, env.rank, env.world_size, env.device, num_flops_per_token(cfg.model, cfg.data.seq_len))))
    # Steps after state.step that an earlier attempt logged are superseded from here on.
    metrics.log_restart(state.step, dict(dp=dims.dp, tp=dims.tp, pp=dims.pp))
    watchdog.start(state.step)  # the first step's allowance from here
    if cfg.train.compile:
        reset_graph_breaks()
    return Training(
        cfg=cfg, env=env, dims=dims, tokens_per_step=tokens_per_step, model=model, runner=runner,
        optimizer=optimizer, lr_scheduler=lr_scheduler, feeder=feeder, val_data=val_data, state=state, states=states,
        val_start=copy.deepcopy(val_data.state_dict()) if val_data is not None else None,
        update=SkippableStep(optimizer, cfg.train.max_nonfinite_steps, state.nonfinite_streak, env.device),
        checkpointer=checkpointer, metrics=metrics, stop=stop, vote=StopVote(timeout), watchdog=watchdog,
        profiler=closing.enter_context(contextlib.closing(StepProfiler(cfg.logging, run_dir, env.rank))),
        collector=closing.enter_context(contextlib.closing(GarbageCollection(cfg.train.gc_interval))))


def _resume(cfg: TrainerConfig, run_dir: Path, env: DistEnv, timeout: timedelta, states: dict,
            watchdog: HangWatchdog) -> Checkpointer:
    """The checkpointer, the latest checkpoint loaded into `states` (or step 0 saved: save_initial)."""
    checkpointer = Checkpointer(run_dir / cfg.checkpoint.dir, cfg.checkpoint,
                                expected_bytes=checkpoint_bytes(cfg.model.num_params()), timeout=timeout,
                                async_save=resolve_async_save(cfg.checkpoint.async_save, env.device),
                                pause=watchdog.paused, saves=RunDir(run_dir).saves)
    step = states["train_state"].step = checkpointer.load_latest(states)
    if step >= cfg.train.steps and env.rank == 0:
        log.warning("this run already reached train.steps=%d (checkpoint at step %d): nothing to train; "
                    "raise train.steps (with --force) or pick another --run-name", cfg.train.steps, step)
    elif step and step < cfg.train.steps:
        log.info("resumed from step %d of %s", step, run_dir / cfg.checkpoint.dir)
        if states["lr_scheduler"].said and env.rank == 0:
            log.info("%s", states["lr_scheduler"].said)
    elif cfg.checkpoint.save_initial:
        checkpointer.save(0, states)
    return checkpointer


def _describe(cfg: TrainerConfig, env: DistEnv, dims: ParallelDims, dtype: torch.dtype, attn_impl: str,
              timeout: timedelta, tokens_per_step: int) -> None:
    """The run's shape and options in the log, and the warnings a config earns before it trains."""
    compiled = cfg.train.compile
    if (torch_warning := unsupported_torch(torch.__version__)) and env.rank == 0:
        log.warning("%s", torch_warning)
    log.info("world %d = pp %d x dp %d x tp %d on %s (%s), %s, attention %s; global batch = micro_batch_size(%d) "
             "x grad_accum_steps(%d) x dp(%d) windows of %d = %d tokens", env.world_size, dims.pp, dims.dp, dims.tp,
             env.device, dist.get_backend() if dist.is_initialized() else "no process group", dtype, attn_impl,
             cfg.train.micro_batch_size, cfg.train.grad_accum_steps, dims.dp, cfg.data.seq_len, tokens_per_step)
    log.info("compile %s, activation checkpointing %s, loss parallel %s, float8 %s, gradient sync %s, "
             "prefetch %s, gc every %s steps", "on" if compiled else "off",
             _ac_name(cfg), "on" if dims.loss_parallel else "off",
             f"on ({cfg.train.float8_recipe})" if cfg.train.float8 else "off",
             cfg.parallel.grad_sync.replace("_", " "), "on" if cfg.train.prefetch else "off",
             cfg.train.gc_interval or "(python's own)")
    if dims.dp > 1 and not dims.ddp:
        reshard, why = resolve_reshard(cfg)
        log.info("FSDP reshards parameters after the forward: %s (%s)", "yes" if reshard else "no", why)
        if dims.tp == 1 and dims.pp == 1 and env.rank == 0:  # the arithmetic is FSDP's alone
            gpu_bytes = (torch.cuda.get_device_properties(env.device).total_memory
                         if env.device.type == "cuda" else None)
            line, warning = memory_report(cfg, dims.dp, reshard, gpu_bytes)
            log.info("%s", line)
            if warning:
                log.warning("%s", warning)
    log.info("collective timeout %g s (hang watchdog: %s)", timeout.total_seconds(),
             f"{cfg.train.hang_timeout:g} s, first step {cfg.train.hang_timeout_first_step:g} s"
             if cfg.train.hang_timeout else "off")
    if cfg.train.float8 and not compiled:
        log.warning("train.float8 without train.compile: the float8 casts then run as kernels of their own and "
                    "the step is slower than in bf16; set train.compile: true")
    if (advice := layout_advice(cfg)) and env.rank == 0:
        log.warning("note: %s", advice)


def _replay(pending: list[tuple[int, float, torch.Tensor]], state: TrainState, cfg: TrainerConfig,
            metrics: MetricsLogger) -> tuple[bool, float, float]:
    """The skipped steps since the last sync (one copy) counted and reported: (latest skipped, loss, norm)."""
    values = torch.stack([v for _, _, v in pending]).tolist()  # the host sync
    limit = cfg.train.max_nonfinite_steps
    for (step, _, _), (loss, grad_norm, skipped) in zip(pending, values):
        if not skipped:
            state.nonfinite_streak = 0
            continue
        state.skipped_steps += 1
        state.nonfinite_streak += 1
        if metrics.enabled:  # rank 0
            log.warning("step %d: loss %s, gradient norm %s: not finite, optimizer update skipped (%d in a row, the "
                        "run stops at %d)", step, loss, grad_norm, state.nonfinite_streak, limit)
        metrics.log_nonfinite(step, loss, grad_norm, state.nonfinite_streak, state.skipped_steps)
        if state.nonfinite_streak >= limit:
            raise NonFiniteError(f"{state.nonfinite_streak} steps in a row (to step {step}) had a non-finite loss "
                                 f"or gradient norm (train.max_nonfinite_steps={limit}); the weights are those of "
                                 f"step {step - state.nonfinite_streak} and no checkpoint was written since: lower "
                                 f"train.lr (now {cfg.train.lr:g}) or raise train.warmup_steps, check the data, then "
                                 "resume from the latest checkpoint")
    loss, grad_norm, skipped = values[-1]
    return bool(skipped), loss, grad_norm


def _ac_name(cfg: TrainerConfig) -> str:
    mode = cfg.train.activation_checkpointing
    if mode != "selective":
        return mode
    return "selective per op" if cfg.train.selective_ac == "op" else f"selective every {cfg.train.selective_ac} blocks"


@contextlib.contextmanager
def _compile_errors(compiled: bool):
    """A torch.compile failure (a block's first call, or a recompile) as compute.compile_error's one line."""
    try:
        yield
    except Exception as exc:
        error = compile_error(exc) if compiled else None
        if error is None:
            raise
        raise error from exc


def evaluate(runner: Runner, val_data: Sampler, val_start: dict, cfg: TrainerConfig, dims: ParallelDims,
             device: torch.device) -> float:
    """Mean loss over eval_batches global batches, the same ones every time."""
    val_data.load_state_dict(copy.deepcopy(val_start))
    total = torch.zeros((), device=device)
    for _ in range(cfg.train.eval_batches):
        total += runner.eval_step(next_batches(val_data, cfg.train.grad_accum_steps, device, device.type == "cuda"))
    return global_mean(total / cfg.train.eval_batches, dims)


def main(argv: Optional[list[str]] = None, data: Optional[DataBuilder] = None) -> int:
    parser = Parser(
        prog="python -m trainer", description="Train the Llama decoder of a run.",
        epilog=f"exit status: 0 done; 1 failed (a checkpoint that does not fit: one error line); "
               f"{BAD_INPUT_EXIT} bad config or input; {NONFINITE_EXIT} stopped on non-finite numbers "
               f"(train.max_nonfinite_steps); {HANG_EXIT} hung (train.hang_timeout: stacks in hangs/); "
               f"{REQUEUE_EXIT} stopped by a signal or the stop file after saving")
    parser.add_argument("--config", required=True, type=Path, help="runs/RUN/config.yaml (its folder is the run)")
    args = parser.parse_args(argv)

    def work() -> int:
        shadowed = check_code(__file__)
        if shadowed:  # the launch named a code snapshot and this is not it: never train other code silently
            raise ConfigError("", shadowed)
        stopped = train(load_trainer_config(args.config), args.config.resolve().parent, data=data)
        return REQUEUE_EXIT if stopped else 0

    # One line from the first rank, not one a rank; a crash keeps its traceback for the log.
    first = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    return run_at_edge(work, prog="", errors={NonFiniteError: NONFINITE_EXIT, CheckpointWriteError: FAILED_EXIT},
                       crashes=True, silent=not first)
