"""What `slipway local` checks before any process starts (jobs/interactive.py): that the try fits
this machine's memory and its time, and that its data, and the preparation a hint would send the
user to, are ready. Each refusal names a command that fits, checked as the user would paste it.

Memory: common/layouts.py's arithmetic against what the machine has free (`available_memory`).
Time: the FLOPs of one step of the whole job (common/layouts.py `step_flops`) against what this
machine's float32 matrix products reach now, measured here in a fraction of a second with numpy:
the host imports no torch, and asking the trainer instead would cost torch's import and the
process group (10 to 40 s) before the answer, and could not refuse before anything started. The
trainer's steps reach about CPU_STEP_EFFICIENCY of that rate, so the estimate errs long. A try
expected to take more than LOCAL_TRY_SECONDS is asked about on a terminal and refused elsewhere
(`--yes` starts it all the same), with the first of these that fits both: fewer steps; one node's
layout (`--nodes 1`); a batch of one sequence a rank; a smaller model.
"""

from __future__ import annotations

import copy
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from common.errors import ConfigError
from common.layouts import CPU_STEP_EFFICIENCY, cpu_step_seconds, fitting_batch, process_memory, step_flops
from common.rundir import complete_checkpoints
from jobs import runs
from jobs.config import Config, this_python
from common.metrics_log import format_duration
from jobs.supervisor import available_memory

# Of the memory free, what a suggested batch plans for: the arithmetic is within about 5% of a
# rank's peak, and the machine's other processes grow too.
FIT_SHARE = 0.8
# The longest a try on this machine runs without being asked for: half an hour is a try; longer
# is a run that wants a cluster, or a choice the user makes knowingly.
LOCAL_TRY_SECONDS = 30 * 60
MIN_TRY_STEPS = 10  # fewer steps than this is no try: a smaller one is suggested instead


def matmul_rate(bursts: int = 5, seconds: float = 0.02, n: int = 384) -> Optional[float]:
    """FLOP/s of float32 n x n matrix products on this machine: one core's, the median of
    `bursts` of `seconds` of this thread's CPU time each after one to warm up (the first products
    of a process run slower), times the cores this process may use. CPU time, not the clock: what
    the cores give, the same answer on a busy machine as on an idle one (`busy` says when the
    cores are shared), so a command suggested from it fits again when pasted. One thread, as
    each rank's torch uses its share: BLAS's own threads spin against the other processes of a
    loaded machine. None without numpy (the trainer extra brings it)."""
    threads = {name: os.environ.get(name) for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    os.environ.update(dict.fromkeys(threads, "1"))  # read once, when numpy loads its BLAS
    try:
        import numpy as np
    except ImportError:
        return None
    finally:
        for name, value in threads.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)

    def burst() -> float:
        done, start = 0, time.thread_time()
        while (elapsed := time.thread_time() - start) < seconds:
            a @ a
            done += 1
        return 2 * n ** 3 * done / elapsed

    burst()
    return statistics.median(burst() for _ in range(bursts)) * len(os.sched_getaffinity(0))


def busy() -> str:
    """A note when other work shares this machine's cores now (the load average past the cores):
    steps take longer than the cores alone would make them."""
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    return f"; this machine is busy (load {load:.0f} on {cores} cores): expect longer" if load > cores else ""


@dataclass
class Fit:
    """A `slipway local` command line that fits this machine: its arguments, what it keeps or
    changes, and its figures."""

    args: str
    what: str
    memory: float  # bytes, all processes
    step_s: Optional[float]
    steps: int  # left to train

    def said(self) -> str:
        time_said = "" if self.step_s is None else (
            f", ~{format_duration(self.step_s, fine=True)} a step, ~{format_duration(self.step_s * self.steps)} for "
            f"{self.steps} steps")
        return f"`slipway local {self.args}` {self.what} (~{self.memory / 1e9:.1f} GB{time_said})"


def gpus_here() -> bool:
    """Whether the trainer started here would find a CUDA GPU (trainer/parallel.py takes one when
    torch sees it): the driver lists one and CUDA_VISIBLE_DEVICES does not hide them all. The CPU
    arithmetic above says nothing of a GPU's step, nor of its memory."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        return any(Path("/proc/driver/nvidia/gpus").iterdir())
    except OSError:
        return False


def plan_here(original: Config, local: Config, run_dir: Path, reload: Callable[[list[str]], Config], console, *,
              yes: bool = False, rename: bool = True) -> Optional[float]:
    """Whether the try `local` (the local view of `original`) fits this machine: refused (a
    ConfigError) when its memory does not, said with its expected time, and asked about or refused
    when that passes LOCAL_TRY_SECONDS. `reload(words)` loads a `slipway local` command line as
    typed, so that a suggested one is checked as it will be pasted. Returns the expected seconds a
    step (None: not known), for the launch's heartbeat."""
    if local.launch.command or local.train.script:
        console.print("[dim]expected step time here: not known (train.script or launch.command trains a model of "
                      "its own)[/]", soft_wrap=True)
        return None
    if gpus_here():
        console.print("[dim]expected step time here: not known (this machine's GPUs train it; the estimate and "
                      "the memory check are for CPUs)[/]", soft_wrap=True)
        return None
    done = _done(local, run_dir)
    available = available_memory()
    world, need = local.launch.procs_per_node, process_memory(local)
    rate = matmul_rate()
    fits = available is None or world * need <= available
    step_s = cpu_step_seconds(local, rate) if rate else None
    left = max(0, local.train.steps - done)
    if not fits:
        fit = first_fit(original, run_dir, reload, rate, available, rename=rename)
        raise ConfigError("train.micro_batch_size",
                          f"{_memory_said(world, need, available)}: {fit.said() if fit else _NOTHING_FITS}")
    if step_s is None:
        return None
    flops, reached = step_flops(local), rate * CPU_STEP_EFFICIENCY
    console.print(f"[dim]expected here: ~{format_duration(step_s, fine=True)} a step, "
                  f"~{format_duration(step_s * left)} for {left} steps (the model's {flops / 1e9:,.1f} GFLOP a step "
                  f"at ~{reached / 1e9:,.0f} GFLOP/s: {CPU_STEP_EFFICIENCY:.0%} of the {rate / 1e9:,.0f} GFLOP/s "
                  f"this machine's float32 matrix products reach), after a start of 5 to 40 s{busy()}[/]",
                  soft_wrap=True)
    if step_s * left <= LOCAL_TRY_SECONDS or yes:
        return step_s
    fit = first_fit(original, run_dir, reload, rate, available, rename=rename)
    over = (f"{left} steps of ~{format_duration(step_s, fine=True)} take ~{format_duration(step_s * left)} here, "
            f"more than a try on this machine ({format_duration(LOCAL_TRY_SECONDS)}): "
            f"{fit.said() if fit else _NOTHING_FITS}")
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise ConfigError("train.steps", f"{over}; or --yes to start it all the same")
    from rich.markup import escape

    from common.environ import as_typed

    console.print(f"[yellow]{escape(as_typed(over))}[/]", soft_wrap=True)
    try:
        answer = input("start it all the same? [y/N] ")
    except EOFError:
        answer = ""
    if answer.strip().lower() not in ("y", "yes"):
        raise ConfigError("train.steps", "not started (nothing written): run the command above, or add --yes")
    return step_s


def check_memory(local: Config) -> None:
    """A sweep's point in its local view: refused, before any point is written, when its
    processes need more memory than this machine has free, naming the batch under which it fits.
    (Its time is asked about as each point starts, by `plan_here`.)"""
    available = available_memory()
    if local.launch.command or local.train.script or available is None or gpus_here():
        return
    world, need = local.launch.procs_per_node, process_memory(local)
    if world * need > available:
        raise ConfigError("train.micro_batch_size", f"{_memory_said(world, need, available)}: "
                                                    f"{smaller_batch(local, FIT_SHARE * available / world)}")


def _memory_said(world: int, need: float, available: float) -> str:
    return (f"{world} processes of about {need / 1e9:.1f} GB each (common/layouts.py's arithmetic) need "
            f"{world * need / 1e9:.1f} GB, this machine has {available / 1e9:.1f} GB free")


_NOTHING_FITS = ("nothing smaller of this layout fits here (not even one sequence a rank on a smaller model): try "
                 "it on a cluster, or with fewer processes (--dp, --tp, --pp)")


def _done(cfg: Config, run_dir: Path) -> int:
    steps = complete_checkpoints(run_dir / cfg.checkpoint.dir)
    return steps[-1] if steps else 0


def _rungs(cfg: Config) -> list[tuple[dict, str]]:
    """Ways to make a try of `cfg` smaller, each the one before with one more change: (the
    settings, what the command keeps or changes)."""
    p, s, t, m = cfg.parallel, cfg.slurm, cfg.train, cfg.model
    rungs: list[tuple[dict, str]] = [({}, "keeps the layout and the global batch")]
    settings: dict = {}
    if s.nodes > 1 and p.dp % s.nodes == 0:
        settings = {"slurm.nodes": 1, "parallel.dp": p.dp // s.nodes}
        rungs.append((dict(settings), f"trains one node's layout (dp {p.dp // s.nodes}: {s.nodes}x fewer sequences a "
                                      "step)"))
    accum = max(1, p.pp)
    if t.micro_batch_size * t.grad_accum_steps > accum:
        settings = {**settings, "train.micro_batch_size": 1, "train.grad_accum_steps": accum}
        rungs.append((dict(settings), "trains a batch of one sequence a rank" + (", on one node's layout"
                                                                                  if "slurm.nodes" in settings else "")))
    heads = p.tp * -(-4 // p.tp)  # at least 4, a multiple of tp; key/value heads: tp
    small = {"model.hidden_size": 32 * heads, "model.intermediate_size": 64 * heads,
             "model.num_layers": max(2, p.pp), "model.num_heads": heads, "model.num_kv_heads": p.tp}
    if m.hidden_size > small["model.hidden_size"] or m.num_layers > small["model.num_layers"]:
        rungs.append(({**settings, **small}, f"trains a smaller model ({small['model.num_layers']} layers of "
                                             f"{small['model.hidden_size']}) with the same data"
                                             + (", one sequence a rank" if "train.grad_accum_steps" in settings else "")))
    return rungs


def local_view(cfg: Config, *, rename: bool) -> tuple[Config, list[str]]:
    """`cfg` as it runs on this machine: the whole dp x tp x pp layout as processes of one
    node, on its CPUs (gloo), with this environment's Python and no container; what changed.

    A cluster config trained here gets its own run directory (`NAME-local`, unless the user
    named the run) so a trial never mixes its checkpoints into the cluster run's."""
    local = copy.deepcopy(cfg)
    changed = []
    world = cfg.parallel.world_size if not cfg.launch.command else cfg.world_size
    if cfg.slurm.nodes != 1 or cfg.launch.procs_per_node != world:
        changed.append(f"{cfg.slurm.nodes} node(s) x {cfg.launch.procs_per_node} -> 1 x {world} processes")
    if cfg.slurm.gpus_per_node:
        changed.append(f"{cfg.slurm.gpus_per_node} GPUs per node -> this machine's CPUs")
    if cfg.container.runtime != "none":
        changed.append(f"runtime {cfg.container.runtime} -> none (this environment's Python)")
    local.slurm.nodes, local.slurm.gpus_per_node = 1, 0
    local.launch.procs_per_node = world
    local.container.runtime = "none"
    local.launch.python = this_python()
    local.launch.preset = "none"  # this machine is not the cluster's node type
    if changed and rename:
        local.run.name = f"{cfg.run.name}-local"
    return local, changed


def first_fit(original: Config, run_dir: Path, reload: Callable[[list[str]], Config], rate: Optional[float],
              available: Optional[int], *, rename: bool = True) -> Optional[Fit]:
    """The first of `_rungs` whose command, loaded as typed, is a valid config that fits this
    machine's memory (a smaller micro batch, else a shorter sequence, where needed) and, with
    `rate`, LOCAL_TRY_SECONDS (fewer steps where needed, at least MIN_TRY_STEPS)."""
    for settings, what in _rungs(original):
        settings = dict(settings)
        for _ in range(3):  # the memory's change, then the time's, each checked by loading it
            cand = _load(original, settings, reload)
            if cand is None:
                break
            local, _ = local_view(cand, rename=rename)
            world = local.launch.procs_per_node
            if available is not None and world * process_memory(local) > FIT_SHARE * available:
                fit = fitting_batch(local, FIT_SHARE * available / world)
                if fit is None:
                    break
                settings.update({"train.micro_batch_size": fit[0], "train.grad_accum_steps": fit[1]})
                if fit[2] != local.data.seq_len:
                    settings["data.seq_len"] = fit[2]
                    what += f", at seq_len {fit[2]} instead of {local.data.seq_len}"
                continue
            done = _done(local, run_dir)
            step_s = cpu_step_seconds(local, rate) if rate else None
            left = max(0, local.train.steps - done)
            if step_s is not None and step_s * left > LOCAL_TRY_SECONDS:
                steps = int(LOCAL_TRY_SECONDS / 2 // step_s)  # half: a busier machine measured next still fits it
                if steps < MIN_TRY_STEPS or "train.steps" in settings:
                    break
                settings["train.steps"] = done + steps
                what += f", {steps} steps" if not done else f", {steps} more steps"
                continue
            args = _runnable(original, local, settings, run_dir)
            return Fit(args, what, world * process_memory(local), step_s, left)
    return None


def _load(original: Config, settings: dict, reload: Callable[[list[str]], Config]) -> Optional[Config]:
    """The config of `original`'s command line with `settings`, as `slipway local` loads it when
    pasted; None where that command would be refused (a bound or rule of the config's own)."""
    try:
        return reload(shlex.split(original.config_args_setting(settings)))
    except (ConfigError, SystemExit):
        return None


def _runnable(original: Config, local: Config, settings: dict, run_dir: Path) -> str:
    """`original`'s arguments with `settings`, and what lets them start where the run exists
    already: --force where only the step count changes (the old config kept in history/), else
    a run of its own (the checkpoints of another model or layout would not load)."""
    if not settings or not (run_dir / "manifest.json").is_file():
        return original.config_args_setting(settings)
    if set(settings) == {"train.steps"}:
        return f"{original.config_args_setting(settings)} --force"
    return original.config_args_setting({**settings, "run.name": f"{local.run.name}-try"})


def smaller_batch(cfg: Config, budget: float) -> str:
    """The `slipway local` command whose processes stay within `budget` bytes each, and what it keeps."""
    fit = fitting_batch(cfg, budget)
    if fit is None:
        return "not even micro batch 1 at a short seq_len fits: try the layout on a smaller model or fewer processes"
    micro, accum, seq = fit
    settings = {"train.micro_batch_size": micro, "train.grad_accum_steps": accum}
    keeps = "the layout and the global batch"
    if seq != cfg.data.seq_len:
        settings["data.seq_len"], keeps = seq, f"the layout, at seq_len {seq} instead of {cfg.data.seq_len}"
    world = cfg.launch.procs_per_node * cfg.slurm.nodes
    return Fit(cfg.config_args_setting(settings), f"keeps {keeps}", world * process_memory(cfg, micro, seq), None,
               0).said()


def check_before_start(sealed: runs.Sealed, original: Config) -> None:
    """What the trainer would refuse only once every process has started (torch imported, the
    process group formed), checked from the config and the token cache's index: files the run
    needs, a token cache `slipway prepare` has not made (the same refusal as `submit`, once that
    command is known to get past its own checks), data too short for the sequence length or the
    validation share, a tokenizer larger than the model's vocabulary."""
    cfg = sealed.cfg
    runs.check_submittable(cfg)
    why = runs.unprepared_data(sealed, original.config_args)
    if why:
        try:  # the suggested `slipway prepare` reads the config as a job would: its paths too
            runs.preparation(original, sealed.paths.project)
        except ConfigError as exc:
            raise ConfigError(exc.field, f"{str(exc).removeprefix(exc.field + ': ')} (the token cache is not "
                                         "prepared, and preparing it with slipway prepare reads this)") from None
        raise ConfigError("data", why)
    _check_data_fits(cfg, sealed.data_status())


def _check_data_fits(cfg: Config, status) -> None:
    """The trainer's window and vocabulary rules (trainer/data.py), from the prepared entries'
    token counts; an entry the job will tokenize itself is judged there."""
    data, window = cfg.data, cfg.data.seq_len + 1
    index = {e.role: e.index for e in status.entries if e.prepared and e.index}
    if "train" not in index:
        return
    train = index["train"]
    n_train, source = int(train["n_tokens"]), train.get("source", data.dataset)
    if int(train.get("vocab_size", 0)) > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than the vocabulary of "
                                              f"data.tokenizer '{data.tokenizer}' ({train['vocab_size']}): set "
                                              f"model.vocab_size >= {train['vocab_size']}")
    if "validation" in index:
        n_val = int(index["validation"]["n_tokens"])
        if n_val < window:
            raise ConfigError("data.validation_split", f"{n_val:,} tokens of {index['validation'].get('source')} "
                                                       f"hold no window of data.seq_len + 1 = {window}: lower "
                                                       "data.seq_len or use more data")
    elif data.validation_fraction > 0 and not data.validation_split:
        n_val = int(n_train * data.validation_fraction)
        if n_val < window:
            raise ConfigError("data.validation_fraction",
                              f"{data.validation_fraction} of {n_train:,} tokens is {n_val}, less than one window "
                              f"of data.seq_len + 1 = {window}: raise it, lower data.seq_len, or set it to 0 to "
                              "skip validation")
        n_train -= n_val
    if n_train < window:
        raise ConfigError("data.dataset", f"{n_train:,} tokens of {source} hold no window of data.seq_len + 1 = "
                                          f"{window}: lower data.seq_len or use more data")
