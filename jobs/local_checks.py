"""What `slipway local` checks before any process starts (jobs/interactive.py), all at once, with
the one command that clears every blocker, checked as the user would paste it (docs/runs.md).

Memory: common/layouts.py's arithmetic against what the machine has free (`available_memory`).
Time: trainer/probe.py's rates of one rank's block and output layer here, on the threads a rank
gets, and the share of the cores it had: a step is its FLOPs at those rates, on the share each
rank will have beside the other work this machine runs and the other ranks.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from common.errors import ConfigError, one_line
from common.layouts import cpu_step_seconds, fitting_batch, process_memory
from common.metrics_log import format_duration
from common.rundir import complete_checkpoints
from common.schema import to_dict
from edf import expand_host
from jobs import runs, trainer_door
from jobs.config import Config, dump_config, interpreter
from jobs.runs import lock as runlock

# Of the memory free, what a suggested batch plans for: the arithmetic is within about 5% of a
# rank's peak, and the machine's other processes grow too.
FIT_SHARE = 0.8
# The longest a try on this machine runs without being asked for: half an hour is a try; longer
# is a run that wants a cluster, or a choice the user makes knowingly.
LOCAL_TRY_SECONDS = 30 * 60
MIN_TRY_STEPS = 10  # fewer steps than this is no try: a smaller one is suggested instead
SLOW_BF16 = 4  # a CPU whose bfloat16 runs this many times slower than its float32 has no bfloat16 units
BUILTIN_DATA = {"data.dataset": "builtin", "data.tokenizer": "builtin", "data.dataset_config": None,
                "data.validation_split": None}


def rank_threads(procs: int) -> int:
    """The threads each of `procs` ranks here gets (OMP_NUM_THREADS): the cores shared out."""
    return max(1, (os.cpu_count() or 1) // procs)


@dataclass
class Speed:
    """How fast this machine trains a config: trainer/probe.py's rates of one rank, by dtype and
    part (FLOP a CPU second), and the threads of other work that shared the cores meanwhile."""

    rates: dict[str, dict[str, float]]
    others: float

    def step_s(self, cfg: Config) -> float:
        procs, threads, cores = cfg.launch.procs_per_node, rank_threads(cfg.launch.procs_per_node), os.cpu_count() or 1
        per_second = min(threads, threads * cores / (self.others + procs * threads))  # CPU seconds a rank gets
        return cpu_step_seconds(cfg, self.rates, cfg.train.dtype if cfg.train.dtype in self.rates else "float32") \
            / per_second

    def slow_bf16(self) -> bool:
        return "bfloat16" in self.rates and self.rates["bfloat16"]["block"] * SLOW_BF16 < self.rates["float32"]["block"]

    def said(self, cfg: Config) -> str:
        dtype = cfg.train.dtype if cfg.train.dtype in self.rates else "float32"
        block, head = (self.rates[dtype][k] / 1e9 for k in ("block", "head"))
        slow = (f"; this CPU runs bfloat16 at {block:,.1f} GFLOP/s, float32 at "
                f"{self.rates['float32']['block'] / 1e9:,.0f}: it has no bfloat16 units" if self.slow_bf16() else "")
        return (f"measured here: a rank's blocks and output layer in {dtype} at {block:,.1f} and {head:,.1f} GFLOP a "
                f"CPU second, {cfg.launch.procs_per_node} rank(s) and ~{self.others:.0f} other busy thread(s) on "
                f"{os.cpu_count()} core(s){slow}")


_measured: dict[str, Speed] = {}  # this process's measurements (a sweep's points share their shapes)


def measure(local: Config) -> tuple[Optional[Speed], str]:
    """trainer/probe.py on `local` with a rank's threads: its rates, and from the share of the
    cores it had, the other work this machine runs now; (None, why) where it cannot tell."""
    threads, text = rank_threads(local.launch.procs_per_node), dump_config(local)
    shapes = json.dumps([to_dict(local.model), to_dict(local.parallel), local.train.dtype, threads,
                         local.train.micro_batch_size, local.data.seq_len], default=str)
    if shapes in _measured:
        return _measured[shapes], ""
    probe = subprocess.run([sys.executable, "-m", "trainer.probe", "--threads", str(threads)], input=text,
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if probe.returncode:
        why = probe.stderr.strip().splitlines()
        return None, f"the measurement failed: {one_line(why[-1] if why else probe.returncode)}"
    found = json.loads(probe.stdout)
    had = max(found.pop("cpu_per_second"), 1e-3)
    _measured[shapes] = Speed(found, max(0.0, threads * (os.cpu_count() or 1) / had - threads))
    return _measured[shapes], ""


@dataclass
class Blocker:
    """What stops a try, and what clears it: config settings (dotted key -> value) or flags."""

    field: str
    text: str
    settings: dict = field(default_factory=dict)
    flags: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.field}: {self.text}"


@dataclass
class Plan:
    """A try's verdict before anything starts: its blockers, the `slipway local` arguments that
    clear them all ("" where none found does), its expected seconds a step and the line saying so."""

    blockers: list[Blocker]
    fix: str = ""
    step_s: Optional[float] = None
    said: str = ""

    def lines(self) -> list[str]:
        """Each blocker, and the command that clears them all (on the line of a single one)."""
        lines = [str(b) for b in self.blockers]
        if self.fix:
            clears = f"`slipway local {self.fix}` clears {'it' if len(lines) == 1 else 'them all'}"
            lines = [f"{lines[0]}; {clears}"] if len(lines) == 1 else [*lines, clears]
        return lines


class Refused(ConfigError):
    """A try refused before anything started: its plan's blockers (each a line) and their fix."""

    def __init__(self, result: Plan) -> None:
        super().__init__(result.blockers[0].field, "; ".join(result.lines())[len(result.blockers[0].field) + 2:])
        self.plan = result


def gpus_here() -> bool:
    """Whether the trainer started here would take a CUDA GPU (trainer/parallel.py), of whose step and
    memory the CPU arithmetic above says nothing."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        return any(Path("/proc/driver/nvidia/gpus").iterdir())
    except OSError:
        return False


def available_memory() -> Optional[int]:
    """Bytes this machine can give a launch now: /proc/meminfo's MemAvailable, less where this
    process's memory cgroup (v1 or v2, a Slurm allocation's or a container's, and each above it)
    leaves less; None where none of that can be read."""
    found = []
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "memory":
                root, files = Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
            elif controllers == "":
                root, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current")
            else:
                continue
            group = root / path.lstrip("/")
            while True:
                with contextlib.suppress(OSError, ValueError):
                    limit, used = ((group / name).read_text().strip() for name in files)
                    if limit != "max" and int(limit) < 2**60:
                        found.append(max(0, int(limit) - int(used)))
                if group == root or root not in group.parents:
                    break
                group = group.parent
    return min(found) if found else None


def plan(original: Config, local: Config, sealed: runs.Sealed, reload: Optional[Callable[[list[str]], Config]], *,
         force: bool = False, prepare: bool = False, speed: Optional[Speed] = None, rename: bool = True,
         fix: bool = True) -> Plan:
    """Every blocker of the try `local` (`original`'s local view) at once, with the command that clears
    them all, checked (`reload` loads a `slipway local` command line as typed; None: a sweep's point,
    which no `slipway local` command stands for: its steps that fit are said instead)."""
    run_dir, blockers = sealed.paths.path, data_blockers(sealed, original, prepare)
    available, too_big = _memory(local)
    if too_big:
        blockers.append(Blocker("train.micro_batch_size", too_big))
    if busy := runlock.busy(run_dir):
        blockers.append(Blocker("run.name", busy, settings={"run.name": free_name(local.run.name, run_dir)}))
    elif not force and (run_dir / "manifest.json").is_file() and \
            (differs := runs.config_difference(sealed.paths.config, sealed.files[sealed.paths.config])):
        steps_only = differs.startswith("a different config (train.steps ") and "," not in differs
        blockers.append(Blocker("run.name", f"run {local.run.name} exists with {differs}: "
                                            + ("--force trains on (the old config kept in history/)" if steps_only else
                                               "another --run-name keeps both (--force would replace its config)"),
                                flags=("--force",) if steps_only else (),
                                settings={} if steps_only else {"run.name": free_name(local.run.name, run_dir)}))
    result = Plan(blockers)
    if not (local.launch.command or local.train.script or gpus_here() or speed is None):
        result.step_s, left = speed.step_s(local), max(0, local.train.steps - _done(local, run_dir))
        result.said = (f"expected here: ~{format_duration(result.step_s, fine=True)} a step, "
                       f"~{format_duration(result.step_s * left)} for {left} steps ({speed.said(local)}), after a "
                       "start of 5 to 40 s")
        if result.step_s * left > LOCAL_TRY_SECONDS:  # a terminal asks about it, once nothing else blocks
            fits = try_steps(result.step_s)
            blockers.append(Blocker("train.steps", f"{left} steps of ~{format_duration(result.step_s, fine=True)} "
                                                   f"take ~{format_duration(result.step_s * left)} here, more than a "
                                                   f"try on this machine ({format_duration(LOCAL_TRY_SECONDS)})" + (
                "" if reload else f": train.steps={local.train.steps - left + fits} fits, or --yes starts it all the "
                                  "same" if fits >= MIN_TRY_STEPS else ": --yes starts it all the same"),
                                    flags=("--yes",)))
    return _fixed(result, original, sealed, reload, available, speed, rename) if fix and blockers and reload else result


def try_steps(step_s: float) -> int:
    """The steps of `step_s` a try runs: half of LOCAL_TRY_SECONDS, so a busier machine measured next still fits them."""
    return int(LOCAL_TRY_SECONDS / 2 // step_s)


_FITS = ("train.micro_batch_size", "train.steps")  # the blockers a smaller try clears (`first_fit`)


def _fixed(result: Plan, original: Config, sealed: runs.Sealed, reload: Callable[[list[str]], Config],
           available: Optional[int], speed: Optional[Speed], rename: bool) -> Plan:
    """`result` with the command that clears all its blockers, if found: the fit of memory and time
    (`first_fit`) and the other blockers' fixes, planned again with what that meets, at most three times."""
    fitted = next((b for b in result.blockers if b.field in _FITS), None)
    fit = first_fit(original, sealed.paths.path, reload, speed, available) if fitted else None
    if fitted:
        fitted.text += f": {fit[1] if fit else _NOTHING_FITS}"
        if fit is None:
            return result
    settings, flags, blockers = dict(fit[0] if fit else {}), set(), result.blockers
    for _ in range(3):
        for b in blockers:
            if not (b.field in _FITS and fit):
                settings.update(b.settings)
                flags.update(b.flags)
        args = " ".join([original.config_args_setting(settings), *sorted(flags - {"--yes"})])
        try:
            cand = reload(shlex.split(args))
            local, _ = local_view(cand, rename=rename and "run.name" not in settings)
            sealed = runs.seal(local, sealed.paths.project)
        except (ConfigError, SystemExit):
            return result
        blockers = plan(cand, local, sealed, reload, force="--force" in flags, prepare="--prepare" in flags,
                        speed=speed, fix=False).blockers
        if not blockers:
            result.fix = args
            break
        if any(not (b.settings or b.flags) or b.field in _FITS for b in blockers):
            break
    return result


_NOTHING_FITS = ("nothing smaller of this layout fits here (not even one sequence a rank on a smaller model): try "
                 "it on a cluster, or with fewer processes (--dp, --tp, --pp)")


def data_blockers(sealed: runs.Sealed, original: Config, prepare: Optional[bool] = None) -> list[Blocker]:
    """What the trainer would refuse only once every process has started (missing files, an unprepared
    token cache, too few tokens, a tokenizer past the vocabulary), checked from the config and the
    cache's index. `prepare`: a try here (--prepare, or builtin data where the hub cannot be reached);
    None: a launch (`slipway run`), told the `slipway prepare` of `original`'s arguments."""
    found = []
    for check in (lambda: runs.check_submittable(sealed.cfg), lambda: _check_tokens(sealed.cfg, sealed.data_status())):
        try:
            check()
        except ConfigError as exc:
            found.append(Blocker(exc.field, str(exc).removeprefix(exc.field + ": ")))
    try:
        status = sealed.data_status()
    except ConfigError:
        return found
    if status.prepared or status.tokenize_in_job or prepare:
        return found
    if prepare is None:
        return found + [Blocker("data", runs.unprepared_data(sealed, original.config_args) or "")]
    missing = "; ".join(e.describe() for e in status.missing)
    hub = any(e.source.kind == "hub" for e in status.missing) and trainer_door.hub_unreachable()
    if hub:
        builtin = {k: v for k, v in BUILTIN_DATA.items() if getattr(sealed.cfg.data, k.split(".")[1]) != v}
        typed = " ".join(f"{k}={'null' if v is None else v}" for k, v in builtin.items())
        return found + [Blocker("data", f"the token cache is not prepared, and {hub}: try it on the corpus that ships "
                                        f"with slipway ({typed}); {missing}", settings=builtin)]
    return found + [Blocker("data", f"the token cache is not prepared: --prepare tokenizes it here first; {missing}",
                            flags=("--prepare",))]


def free_name(name: str, run_dir: Path, kind: str = "try") -> str:
    """A run name beside `name` (whose run is `run_dir`) that no run has yet: NAME-try, NAME-try2, ..."""
    names = (f"{name}-{kind}{n if n > 1 else ''}" for n in range(1, 10**4))
    return next(n for n in names if not (run_dir.parent / n).exists())


def _memory(local: Config) -> tuple[Optional[int], str]:
    """What this machine has free for the processes of `local` (None where it is not judged: a
    program of the user's, a GPU's), and why they do not fit in it ("" where they do)."""
    available = None if local.launch.command or local.train.script or gpus_here() else available_memory()
    world, need = local.launch.procs_per_node, process_memory(local)
    if available is None or world * need <= available:
        return available, ""
    return available, (f"{world} processes of about {need / 1e9:.1f} GB each (common/layouts.py's arithmetic) need "
                       f"{world * need / 1e9:.1f} GB, this machine has {available / 1e9:.1f} GB free")


def _done(cfg: Config, run_dir: Path) -> int:
    steps = complete_checkpoints(run_dir / cfg.checkpoint.dir)
    return steps[-1] if steps else 0


def _rungs(cfg: Config, speed: Optional[Speed]) -> list[tuple[dict, str]]:
    """Ways to make a try of `cfg` smaller, each the one before with one more change, and what it keeps."""
    p, s, t, m = cfg.parallel, cfg.slurm, cfg.train, cfg.model
    rungs: list[tuple[dict, str]] = [({}, "keeps the layout and the global batch")]
    settings: dict = {}
    if speed is not None and speed.slow_bf16() and t.dtype == "bfloat16":
        settings = {"train.dtype": "float32"}
        rungs.append((dict(settings), "trains in float32, which this CPU runs faster"))
    if s.nodes > 1 and p.dp % s.nodes == 0:
        settings = {**settings, "slurm.nodes": 1, "parallel.dp": p.dp // s.nodes}
        rungs.append((dict(settings), f"trains one node's layout (dp {p.dp // s.nodes}: {s.nodes}x fewer sequences a "
                                      "step)"))
    if t.micro_batch_size * t.grad_accum_steps > max(1, p.pp):
        settings = {**settings, "train.micro_batch_size": 1, "train.grad_accum_steps": max(1, p.pp)}
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
    """`cfg` as it runs here: its dp x tp x pp layout as one node's CPU processes, this Python, no
    container; and what changed. A changed run gets its own name (`NAME-local` with `rename`), so a
    trial never mixes its checkpoints into the cluster run's."""
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
    local.launch.python = interpreter(sys.executable)
    local.launch.preset = "none"  # this machine is not the cluster's node type
    if changed and rename:
        local.run.name = f"{cfg.run.name}-local"
    if cfg.launch.hf_home:  # a cluster's path, such as ${SCRATCH}/hf, may name what this shell lacks
        try:
            expand_host(cfg.launch.hf_home, "launch.hf_home")
        except ConfigError:
            local.launch.hf_home = None
            here = "$HF_HOME" if os.environ.get("HF_HOME") else "the project's cache"
            changed.append(f"launch.hf_home {cfg.launch.hf_home} -> {here} (it names a variable this shell does not set)")
    return local, changed


def first_fit(original: Config, run_dir: Path, reload: Callable[[list[str]], Config], speed: Optional[Speed],
              available: Optional[int]) -> Optional[tuple[dict, str]]:
    """The settings of the first of `_rungs` whose command, loaded as typed, fits this machine's
    memory (a smaller batch or sequence where needed) and, with `speed`, LOCAL_TRY_SECONDS (fewer
    steps, at least MIN_TRY_STEPS); and what they keep or change, with its figures."""
    for settings, what in _rungs(original, speed):
        settings = dict(settings)
        for _ in range(3):  # the memory's change, then the time's, each checked by loading it
            try:
                local, _ = local_view(reload(shlex.split(original.config_args_setting(settings))), rename=False)
            except (ConfigError, SystemExit):  # a bound or rule of the config's own
                break
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
            done, step_s = _done(local, run_dir), speed.step_s(local) if speed else None
            left = max(0, local.train.steps - done)
            if step_s is not None and step_s * left > LOCAL_TRY_SECONDS:
                steps = try_steps(step_s)
                if steps < MIN_TRY_STEPS or "train.steps" in settings:
                    break
                settings["train.steps"] = done + steps
                what += f", {steps} steps" if not done else f", {steps} more steps"
                continue
            time_said = "" if step_s is None else (f", ~{format_duration(step_s, fine=True)} a step, "
                                                   f"~{format_duration(step_s * left)} for {left} steps")
            return settings, f"a try that fits {what} (~{world * process_memory(local) / 1e9:.1f} GB{time_said})"
    return None


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
    return (f"`slipway local {cfg.config_args_setting(settings)}` keeps {keeps} "
            f"(~{world * process_memory(cfg, micro, seq) / 1e9:.1f} GB)")


def check_memory(local: Config) -> None:
    """A sweep's point (local view) refused before any point is written when its processes need more
    memory than is free, naming a batch that fits; its other blockers `plan` says as it starts."""
    available, too_big = _memory(local)
    if too_big:
        budget = FIT_SHARE * available / local.launch.procs_per_node
        raise ConfigError("train.micro_batch_size", f"{too_big}: {smaller_batch(local, budget)}")


def _check_tokens(cfg: Config, status) -> None:
    """trainer/prepare.py `check_tokens` on the prepared entries (one the job tokenizes is judged there)."""
    index = {e.role: e.index for e in status.entries if e.prepared and e.index}
    if "train" in index:
        trainer_door.check_tokens(cfg.data, cfg.model.vocab_size, index["train"], index.get("validation"))
