"""The training loop: `python -m trainer --config runs/RUN/config.yaml`.

`train(cfg, run_dir)` reads top to bottom: processes and mesh, data, model,
optimizer, checkpoint resume, then the steps (forward/backward, clip, step,
log, evaluate, checkpoint, stop on a signal). The run directory is the config
file's directory; metrics.jsonl, checkpoints/ and profiler/ go there.

The host does not wait for the device inside a step. What a step reports
(its loss averaged over ranks, gradient norm, and whether its update was
skipped) stays on the device until a sync step: a logged step
(`logging.interval`, the first step of each attempt, the last), a step with
a checkpoint due, or one on which the run stops. There the host reads every
step since the last sync in one copy and writes their records. Stop requests
travel on the host instead, and only on sync steps: there each rank's stop
flag (a signal it received; the stop file, which rank 0 alone looks for) goes
into a gloo all-reduce started at the step's beginning and read at its end, so
all ranks stop after the same step, and no step costs more as ranks are added
(a request waits at most `logging.interval` steps). Batches for the next step
are read (pinned and copied, on CUDA) while this one runs, and Python's
garbage collector runs every `train.gc_interval` steps on every rank at once.
With train.compile, the first step's log names the graph breaks compilation
found (each a silent slowdown otherwise).

Non-finite numbers are never trained on nor saved: a step whose loss or
gradient norm is not finite on any rank skips its optimizer update, decided
on the device (`trainer.optim.SkippableStep`); it is logged and counted as
`skipped_steps` in metrics.jsonl at the next sync step, and
`train.max_nonfinite_steps` of them in a row stop the run there (the updates
after the streak reached the limit are skipped too, so the weights are those
of the last good step). A checkpoint that would hold a non-finite value is
refused, and an interval save that falls inside a run of skipped steps waits
for the next good step, so such steps never rotate good checkpoints out.

Exit status of `python -m trainer`: 0 done; 2 bad config or input (one
`error:` line); 3 (NONFINITE_EXIT) stopped on non-finite numbers, with the
latest checkpoint left as the last good one; 1 a checkpoint did not fit where
checkpoints go (one `error:` line; any other crash is 1 with its traceback); 75 (EX_TEMPFAIL) stopped by a
signal or the stop file after saving, to be requeued; 4 (HANG_EXIT) no step
completed for train.hang_timeout: stacks in hangs/ (trainer/watchdog.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import logging
import os
import re
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from trainer.compute import check_float8, compile_error, graph_break_report, reset_graph_breaks, resolve_compile
from kernel.errors import ConfigError
from kernel.rundir import NONFINITE_EXIT, REQUEUE_EXIT, STOP_FILE
from trainer.config import TrainerConfig, load_trainer_config
from trainer.layouts import layout_advice, memory_report, resolve_reshard
from trainer.metrics import MetricsLogger, StepProfiler, setup_logging
from trainer.watchdog import HangWatchdog, collective_timeout
from trainer.model import num_flops_per_token, select_attention
from trainer.optim import SkippableStep, build_lr_scheduler, build_optimizer, clip_grad_norm_
from trainer.parallel import (Batch, ParallelDims, Runner, build_model, build_runner, distributed_session,
                              global_mean, resolve_dtype, step_stats)
from trainer.checkpoint import Checkpointer, CheckpointWriteError, ModelState, NonFiniteError, OptimizerState, RNGState
from trainer.preflight import AllReduceGate, checkpoint_bytes
from kernel.rundir import check_code

log = logging.getLogger(__name__)

EX_TEMPFAIL = REQUEUE_EXIT  # "requeue me": stopped by a signal after saving a checkpoint


# The torch releases CI tests (the oldest and newest ends: `make test-oldest`, `make test`),
# the same range as pyproject's `trainer` extra and the Makefile's TORCH_SPEC.
SUPPORTED_TORCH = ((2, 10), (2, 13))


def unsupported_torch(version: str) -> Optional[str]:
    """A one-line warning when torch `version` (torch.__version__: 2.13.0+cpu, NGC's 2.10.0a0+...)
    is outside SUPPORTED_TORCH; None inside it, or when the version cannot be read."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return None
    found = (int(match[1]), int(match[2]))
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TORCH
    if (lo_major, lo_minor) <= found <= (hi_major, hi_minor):
        return None
    return (f"torch {version} is outside the supported range {lo_major}.{lo_minor} to {hi_major}.{hi_minor} (the "
            f"releases tested): install torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1} if this run "
            "misbehaves")


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
    timeout = collective_timeout(cfg.train)  # longer than the hang watchdog's limits: it speaks first
    # The batch script's preflight all-reduce, first in this process group (trainer/preflight.py):
    # bounded from before the group forms, and over before any data or model work.
    gate = AllReduceGate.from_environ()
    if gate is not None:
        gate.arm()
    with distributed_session(timeout) as env:
        if gate is not None:
            gate.check(env.device)
        setup_logging(cfg.logging.level, env.rank)
        torch_warning = unsupported_torch(torch.__version__)
        if torch_warning and env.rank == 0:
            log.warning("%s", torch_warning)
        dims = ParallelDims.from_config(cfg.parallel, env.world_size)
        dims.build_mesh(env.device.type, timeout)
        dtype = resolve_dtype(cfg.train.dtype, env.device)
        attn_impl = select_attention(cfg.model, env.device, dtype)  # config errors: before the data work
        check_float8(cfg.train, env.device)
        compiled = resolve_compile(cfg.train.compile, env.device)
        torch.manual_seed(cfg.run.seed)
        accum = cfg.train.grad_accum_steps
        tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len * accum * dims.dp
        log.info("world %d = pp %d x dp %d x tp %d on %s (%s), %s, attention %s; global batch = micro_batch_size(%d) "
                 "x grad_accum_steps(%d) x dp(%d) windows of %d = %d tokens", env.world_size, dims.pp, dims.dp, dims.tp,
                 env.device, dist.get_backend() if dist.is_initialized() else "no process group", dtype, attn_impl,
                 cfg.train.micro_batch_size, accum, dims.dp, cfg.data.seq_len, tokens_per_step)
        log.info("compile %s, activation checkpointing %s, loss parallel %s, float8 %s, gradient sync %s, "
                 "prefetch %s, gc every %s steps", "on" if compiled else "off",
                 _ac_name(cfg), "on" if dims.loss_parallel else "off", "on" if cfg.train.float8 else "off",
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
                        "the step is slower than in bf16; set train.compile: auto or true")
        advice = layout_advice(cfg)
        if advice and env.rank == 0:
            log.warning("note: %s", advice)

        train_data, val_data, vocab_size = (data or _default_data())(cfg, run_dir, dims.dp_rank, dims.dp)
        if vocab_size > cfg.model.vocab_size:
            raise ConfigError("model.vocab_size", f"the tokenizer has {vocab_size} tokens but model.vocab_size is "
                              f"{cfg.model.vocab_size}: set model.vocab_size >= {vocab_size}")
        feeder = BatchFeeder(train_data, accum, env.device, read_ahead=cfg.train.prefetch)
        model = build_model(cfg, dims, env.device, dtype, attn_impl)
        runner = build_runner(model, dims, cfg, env.device, dtype)
        optimizer = build_optimizer(model, cfg.train, env.device)
        lr_scheduler = build_lr_scheduler(optimizer, cfg.train)
        state = TrainState()
        # What a checkpoint holds; model and optimizer under full-model names, so any
        # dp/tp/pp layout can load what another saved.
        states = {"model": ModelState([model]), "optimizer": OptimizerState([model], [optimizer]),
                  "lr_scheduler": lr_scheduler, "data": feeder, "train_state": state, "rng": RNGState()}
        checkpointer = Checkpointer(run_dir / cfg.checkpoint.dir, cfg.checkpoint,
                                    expected_bytes=checkpoint_bytes(cfg.model.num_params()), timeout=timeout)
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
        stop = StopSignal(run_dir / STOP_FILE, watch_file=env.rank == 0)
        vote = StopVote(timeout)
        update = SkippableStep(optimizer, cfg.train.max_nonfinite_steps, state.nonfinite_streak, env.device)
        collector = GarbageCollection(cfg.train.gc_interval)
        evaluating = val_data is not None and cfg.train.eval_interval > 0 and runner.can_eval
        if val_data is not None and cfg.train.eval_interval > 0 and not runner.can_eval:
            log.warning("evaluation off: this torch has no forward-only pipeline schedule (torch >= 2.9 has)")
        val_start = copy.deepcopy(val_data.state_dict()) if val_data is not None else None
        result = TrainResult(state.step, None, requeue=False)
        pending: list[tuple[int, float, torch.Tensor]] = []  # (step, lr, step_stats + skip) since the last sync
        first_step = state.step + 1  # this attempt's warm-up: compile, first allocations; not in tokens/s
        window_start, window_steps, data_s = time.perf_counter(), 0, 0.0
        save_due = False
        watchdog = HangWatchdog(cfg.train, run_dir, env.rank).start(state.step)  # hangs: trainer/watchdog.py
        if compiled:
            reset_graph_breaks()
        try:
            while state.step < cfg.train.steps:
                state.step += 1
                last = state.step == cfg.train.steps
                profiler.begin(state.step)
                # Whether this is a sync step is known up front and the same on every rank.
                save_due = save_due or state.step % cfg.checkpoint.interval == 0
                sync = (save_due or state.step % cfg.logging.interval == 0 or last or state.step == first_step)
                if sync:
                    vote.start(stop.requested())  # read at the end of the step: by then it is long done
                t0 = time.perf_counter()
                batches = feeder.next(read_ahead=not last)
                data_s += time.perf_counter() - t0
                with _compile_errors(compiled):
                    loss = runner.train_step(batches)
                grad_norm = clip_grad_norm_(model.parameters(), cfg.train.grad_clip, dims.pp_group)
                lr = lr_scheduler.get_last_lr()[0]
                stats = step_stats(loss, grad_norm, dims)  # on the device: loss, norm, non-finite
                skipped = update.step(stats[2])
                with warnings.catch_warnings():  # a skipped first step (foreach path) is not the misuse torch warns of
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
                    lr_scheduler.step()  # the schedule moves on with the step count, skipped or not
                optimizer.zero_grad(set_to_none=True)
                pending.append((state.step, lr, torch.cat([stats[:2], skipped[None]])))
                profiler.end(state.step)
                collector.step(state.step)
                window_steps += 1

                stopping = vote.result() if sync else False
                watchdog.step_done(state.step)  # a step completed on every rank: tell the hang watchdog
                if compiled and state.step == first_step and env.rank == 0:
                    log.info("%s", graph_break_report())
                if not sync:
                    continue
                logging_due = (state.step % cfg.logging.interval == 0 or last or stopping
                               or state.step == first_step)
                # A sync step: the host waits for the device here and nowhere else in the loop.
                nonfinite, loss_value, grad_norm_value = _replay(pending, state, cfg, metrics)
                pending.clear()
                if logging_due:
                    result.loss = loss_value
                    elapsed = time.perf_counter() - window_start
                    if state.step == first_step:
                        metrics.log_train(state.step, loss_value, lr, grad_norm_value, 0, 0.0, 1, data_s,
                                          skipped_steps=state.skipped_steps, warmup_s=elapsed)
                    else:
                        metrics.log_train(state.step, loss_value, lr, grad_norm_value, tokens_per_step * window_steps,
                                          elapsed, window_steps, data_s, skipped_steps=state.skipped_steps)
                    window_start, window_steps, data_s = time.perf_counter(), 0, 0.0
                t_aside = time.perf_counter()  # evaluation and saving are not training time
                if evaluating and state.step % cfg.train.eval_interval == 0:
                    with _compile_errors(compiled):
                        metrics.log_eval(state.step, evaluate(runner, val_data, val_start, cfg, dims, env.device))
                result.step, result.requeue = state.step, stopping and not last
                if last or result.requeue or (save_due and not nonfinite):
                    checkpointer.save(state.step, states, final=last)  # refuses non-finite values
                    save_due = False
                elif save_due and state.nonfinite_streak == 1 and env.rank == 0:
                    log.warning("step %d: checkpoint deferred to the next step with a finite loss and gradient "
                                "norm", state.step)
                window_start += time.perf_counter() - t_aside
                if result.requeue:
                    log.warning("stopping after step %d on %s: exit %d to be requeued", state.step,
                                stop.received or "a request seen by another rank", EX_TEMPFAIL)
                    break
        finally:
            watchdog.stop()
            collector.close()
            stop.restore()
            profiler.close()
            metrics.close()
            checkpointer.close()
        return result


def _replay(pending: list[tuple[int, float, torch.Tensor]], state: "TrainState", cfg: TrainerConfig,
            metrics: MetricsLogger) -> tuple[bool, float, float]:
    """The steps since the last sync, read from the device in one copy: count and report the
    skipped ones (raising NonFiniteError where a streak reached train.max_nonfinite_steps).
    Returns (the latest step was skipped, its loss, its gradient norm)."""
    values = torch.stack([v for _, _, v in pending]).tolist()  # the host sync
    for (step, _, _), (loss, grad_norm, skipped) in zip(pending, values):
        if skipped:
            state.skipped_steps += 1
            state.nonfinite_streak += 1
            _skipped(step, state, cfg, metrics, loss, grad_norm)
        else:
            state.nonfinite_streak = 0
    loss, grad_norm, skipped = values[-1]
    return bool(skipped), loss, grad_norm


def _ac_name(cfg: TrainerConfig) -> str:
    mode = cfg.train.activation_checkpointing
    if mode != "selective":
        return mode
    return "selective per op" if cfg.train.selective_ac == "op" else f"selective every {cfg.train.selective_ac} blocks"


@contextlib.contextmanager
def _compile_errors(compiled: bool):
    """A torch.compile failure (on the first call of a block, or a recompile later) as a
    ConfigError naming train.compile, instead of a page of inductor traceback."""
    try:
        yield
    except Exception as exc:
        error = compile_error(exc) if compiled else None
        if error is None:
            raise
        raise error from exc


def _skipped(step: int, state: "TrainState", cfg: TrainerConfig, metrics: MetricsLogger, loss: float,
             grad_norm: float) -> None:
    """Report a skipped step; stop the run when max_nonfinite_steps have come in a row."""
    limit = cfg.train.max_nonfinite_steps
    if metrics.enabled:  # rank 0
        log.warning("step %d: loss %s, gradient norm %s: not finite, optimizer update skipped (%d in a row, the run "
                    "stops at %d)", step, loss, grad_norm, state.nonfinite_streak, limit)
    metrics.log_nonfinite(step, loss, grad_norm, state.nonfinite_streak, state.skipped_steps)
    if state.nonfinite_streak >= limit:
        good = step - state.nonfinite_streak
        raise NonFiniteError(f"{state.nonfinite_streak} steps in a row (to step {step}) had a non-finite loss "
                             f"or gradient norm (train.max_nonfinite_steps={limit}); the weights are those of step "
                             f"{good} and no checkpoint was written since: lower train.lr (now {cfg.train.lr:g}) or "
                             "raise train.warmup_steps, check the data, then resume from the latest checkpoint")


def evaluate(runner: Runner, val_data: Sampler, val_start: dict, cfg: TrainerConfig, dims: ParallelDims,
             device: torch.device) -> float:
    """Mean loss over eval_batches global batches, the same ones every time."""
    val_data.load_state_dict(copy.deepcopy(val_start))
    total = torch.zeros((), device=device)
    for _ in range(cfg.train.eval_batches):
        total += runner.eval_step(_next_batches(val_data, cfg.train.grad_accum_steps, device, device.type == "cuda"))
    return global_mean(total / cfg.train.eval_batches, dims)


def _next_batches(sampler: Sampler, n: int, device: torch.device, pin: bool = False) -> list[Batch]:
    """n micro batches on `device`. Pinned first (CUDA), the copies do not block the host:
    from pageable memory non_blocking=True is a synchronous copy."""
    batches = [sampler.next_batch() for _ in range(n)]
    if pin:
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
    return [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches]


class BatchFeeder:
    """One step's micro batches at a time, the next step's read ahead (train.prefetch) so that
    reading, pinning and copying them overlap the step running on the device.

    It stands for the sampler in checkpoints: its state is the position after the batches
    handed out, not after those read ahead, so a resumed run trains on the same batches."""

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
        return _next_batches(self.sampler, self.n, self.device, self.pin)

    def state_dict(self) -> dict:
        return self._state if self._ahead is not None else self.sampler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.sampler.load_state_dict(state_dict)
        self._ahead, self._state = None, None


class GarbageCollection:
    """Python's cyclic garbage collector off, and a young-generation collection every
    `interval` steps instead (torchtitan's GarbageCollection): the collector otherwise runs
    when allocation counts say so, at a different moment on each rank, and the rank it pauses
    holds every other rank up at the next collective. 0 leaves the collector alone."""

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
    only sets a flag; ranks agree on it on sync steps (`StopVote`) so that all
    stop on the same step, whichever of them saw it. Only `watch_file` ranks
    (rank 0) look for the file: one stat a sync step, not one per rank."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, stop_file: Path, watch_file: bool = True):
        self.received: Optional[str] = None
        self.stop_file = stop_file
        self.watch_file = watch_file
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        """Whether this rank saw a signal or the stop file (`StopVote` tells it about the others)."""
        if self.received is None and self.watch_file and self.stop_file.exists():
            self.received = f"the stop file {self.stop_file.name}"
        return self.received is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class StopVote:
    """Whether any rank asked to stop, agreed without touching the device: an all-reduce (max)
    of each rank's flag over a gloo group of CPU tensors, started at the beginning of a sync
    step and read at its end. All ranks read the same result after the same step, so all stop
    together; a request that arrives later is seen at the start of the next sync step.
    `rounds` counts the all-reduces."""

    def __init__(self, timeout: Optional[timedelta] = None):
        # Its own group: the default one may be NCCL (device tensors, a stream to wait on), and
        # on CPU runs these small votes should not queue behind the gradient collectives.
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self._flag = torch.zeros(1)
        self._work = None
        self.rounds = 0

    def start(self, requested: bool) -> None:
        self._flag = torch.full((1,), float(requested))
        if self.group is not None:
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self.rounds += 1

    def result(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return bool(self._flag[0])


def _default_data() -> DataBuilder:
    from trainer.data import build_data

    return build_data


def main(argv: Optional[list[str]] = None, data: Optional[DataBuilder] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer", description="Train the Llama decoder of a run.",
        epilog=f"exit status: 0 done; 1 failed (a checkpoint that does not fit: one error line); "
               f"2 bad config or input; {NONFINITE_EXIT} stopped on non-finite numbers "
               f"(train.max_nonfinite_steps); {EX_TEMPFAIL} stopped by a signal or the stop file after saving")
    parser.add_argument("--config", required=True, type=Path, help="runs/RUN/config.yaml (its folder is the run)")
    args = parser.parse_args(argv)
    shadowed = check_code(__file__)
    if shadowed:  # the launch named a code snapshot and this is not it: never train other code silently
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            print(f"error: {shadowed}", file=sys.stderr)
        return 2
    try:
        cfg = load_trainer_config(args.config)
        result = train(cfg, args.config.resolve().parent, data=data)
    except (ConfigError, NonFiniteError, CheckpointWriteError) as exc:
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":  # one line, not one per rank
            print(f"error: {exc}", file=sys.stderr)
        return {NonFiniteError: NONFINITE_EXIT, CheckpointWriteError: 1}.get(type(exc), 2)
    return EX_TEMPFAIL if result.requeue else 0
