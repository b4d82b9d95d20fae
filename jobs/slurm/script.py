"""The batch script: one pure render function for every runtime and launcher (the line that
starts the ranks is jobs/slurm/ranks.py's). Every config value in it goes through `shlex.quote`
(or `shell_value`, which keeps `${VAR}`), so no run name, path or env value can run a command.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from common.errors import ConfigError
from common.layouts import ALLOC_CONF, ALLOC_CONF_NAMES, checkpoint_bytes, smaller_batch_hint
from common.rundir import (BAD_INPUT_EXIT, CANCEL_EXIT, HANG_EXIT, PREFLIGHT_EXIT, PREFLIGHT_FAILED_FILE,
                           REQUEUE_EXIT, TERM_EXIT, CodeSnapshot, RunDir)
from edf import Environment
from jobs.config import Config
from jobs.slurm.bad_nodes import bad_nodes_settings, merged_exclude
from jobs.config.sections import NODE_PRESETS
from jobs.slurm.client import srun_argv
from jobs.slurm.ranks import Value, container_args, launch_line, shell_value, words
from jobs.slurm import preflight, warm as warm_ranks

HEARTBEAT_SECONDS = 60
NODE_HEARTBEAT_SECONDS = 15  # heartbeats/NODE, which `slipway watch` shows by age


def sbatch_quote(value: str) -> str:
    """A value for an `#SBATCH` line: sbatch splits those lines itself (not a shell),
    honouring double quotes and backslash escapes."""
    if "\n" in value:
        raise ConfigError("", f"value {value!r} contains a newline and cannot go into an #SBATCH line")
    if re.fullmatch(r"[A-Za-z0-9_.,:@%/+=-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _allocation(cfg: Config, *, partition: str | None) -> list[str]:
    s = cfg.slurm
    opts = [f"--{name}={sbatch_quote(value)}" for name, value in
            (("account", s.account), ("partition", partition), ("qos", s.qos), ("mem", s.mem)) if value]
    return opts + ([f"--mail-user={sbatch_quote(s.email)}", "--mail-type=END,FAIL"] if s.email else [])


def sbatch_header(cfg: Config, paths: RunDir, exclude: Sequence[str] = ()) -> list[str]:
    """The script's first lines: what the job asks of Slurm (a sweep's arrays group its points by them)."""
    s = cfg.slurm
    tasks = 1 if cfg.launcher == "torchrun" else cfg.launch.procs_per_node
    opts = [f"--job-name={cfg.run.name}", f"--nodes={s.nodes}", f"--ntasks-per-node={tasks}",
            f"--cpus-per-task={s.cpus_per_task}", *([f"--gpus-per-node={s.gpus_per_node}"] if s.gpus_per_node else []),
            f"--time={s.time}", *_allocation(cfg, partition=s.partition)]
    opts += [f"--output={sbatch_quote(str(paths.path / s.output))}",
             f"--error={sbatch_quote(str(paths.path / s.error))}", "--open-mode=append"]
    # B: only the batch shell gets the warning (it tells the trainer by STOP_FILE); warning_timer may ask earlier.
    opts += [f"--signal=B:USR1@{s.warning_seconds()}"] if s.warning_seconds() else []
    extra, excluded = merged_exclude(s.extra, list(exclude))
    opts += ["--requeue" if s.requeue else "--no-requeue", *(sbatch_quote(o) for o in extra)]
    opts += [f"--exclude={sbatch_quote(','.join(excluded))}"] if excluded else []
    return ["#!/bin/bash", f"# slipway run {cfg.run.name}: generated, edit configs/ instead"] + \
        [f"#SBATCH {o}" for o in opts]


def _hf_home(cfg: Config, paths: RunDir) -> str:
    """The user's HF_HOME wins over the project's cache; a config value wins over both."""
    if cfg.launch.hf_home:
        return f"export HF_HOME={shell_value(cfg.launch.hf_home)}"
    return f'[ -n "${{HF_HOME:-}}" ] || export HF_HOME={shlex.quote(str(paths.project / ".cache" / "huggingface"))}'


# The job library and its parts (pyxis_lib for pyxis jobs alone), pinned into each run directory
# by their hash (`library_files`) and sourced by job.sbatch once that hash is checked.
LIBRARIES = {name: Path(__file__).with_name(f"{name}.sh").read_text()
             for name in ("job_lib", "bad_nodes_lib", "requeue_lib", "verify_lib", "pyxis_lib")}
JOB_LIB, PYXIS_LIB = LIBRARIES["job_lib"], LIBRARIES["pyxis_lib"]
EVENT_WRITER = next(line for line in JOB_LIB.splitlines() if line.startswith("event() "))


def library_files(env: Environment, paths: RunDir) -> dict[Path, str]:
    """The libraries a job of `env` sources, by their place (RunDir.lib/NAME-HASH12.sh: a new text is a
    new file, never an old one rewritten)."""
    return {paths.lib / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.sh": text
            for name, text in LIBRARIES.items() if name != "pyxis_lib" or env.runtime == "pyxis"}


@dataclass(frozen=True)
class Pins:
    """What a job runs, pinned at submission and checked on every node (verify_lib.sh); `build`: the
    image build whose container pyxis keeps on the nodes (`jobs.runs.image.kept_build`)."""

    code: Optional[CodeSnapshot] = None
    image_file: Optional[str] = None
    image_sha256: Optional[str] = None  # of its bytes, where the submission knew it
    image_size: Optional[int] = None
    image_mtime: Optional[int] = None  # seconds, as stat -c %Y gives them
    image_identity: Optional[str] = None  # what the kept container is of: the build hash or the bytes'
    build: Optional[str] = None
    project: Optional[str] = None  # the token the project's pyxis containers are named with (containers/project.py)


# Seconds on_exit waits for a stopped step and a container's removal.
STEP_STOP_WAIT = 30
CONTAINER_REMOVE_WAIT = 5
# After `slipway cancel` (which waits CANCEL_GRACE_SECONDS, 90, for the job) the removal gets longer:
# measured on the real pyxis, a loaded node needs more than CONTAINER_REMOVE_WAIT.
CANCEL_REMOVE_WAIT = 45
STALE_REMOVE_TIMEOUT = 600  # the sweep of stale containers at a job's start, in the background


def _code_environment(code: Optional[CodeSnapshot]) -> list[str]:
    if code is None:
        return ["# code.snapshot: false: the ranks run the code installed where they run (the image's)."]
    return [f"# The run's code: snapshot {code.hash12} (jobs/runs/code.py), in front of any installed trainer;",
            "# containers get the same by their environment (env.toml / --container-env) and a mount.",
            f"export SLIPWAY_CODE={shlex.quote(code.dir)}",
            f'export PYTHONPATH={shlex.quote(code.environment()["PYTHONPATH"])}"${{PYTHONPATH:+:$PYTHONPATH}}"',
            "export PYTHONSAFEPATH=1"]


def _environment(cfg: Config, paths: RunDir, code: Optional[CodeSnapshot] = None) -> list[str]:
    debug, hf_home = cfg.launch.debug, _hf_home(cfg, paths)
    per_task = cfg.launch.procs_per_node if cfg.launcher == "torchrun" else 1  # processes sharing its CPUs
    lines = [
        "# Rendezvous: the first host of the allocation, never `hostname --ip-address`. sed reads",
        "# the whole list: `head` would close the pipe early, and pipefail would kill the script",
        "# with SIGPIPE on large allocations.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        "# A port from the job id, below the ephemeral range, moved on while one is taken.",
        "MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 12000 ))",
        'while (exec 3<>"/dev/tcp/$MASTER_ADDR/$MASTER_PORT") 2>/dev/null; do MASTER_PORT=$(( MASTER_PORT + 1 )); done',
        "export MASTER_ADDR MASTER_PORT",
        "# CUDA_DEVICE_MAX_CONNECTIONS stays unset: FSDP2 overlaps its collectives with compute on",
        "# streams of their own, which =1 would serialise (docs/trainer.md).",
        hf_home,
        "# Secrets stay in the environment they came from (container.env_from_host): never written",
        "# here, never expanded into a command that set -x would print (hence :+set, not the value).",
        'if [ -n "${WANDB_API_KEY:+set}" ]; then export WANDB_MODE="${WANDB_MODE:-online}"; '
        "else export WANDB_MODE=offline; fi",
        f"export NCCL_DEBUG={'INFO' if debug else '${NCCL_DEBUG:-WARN}'}",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "export PYTHONFAULTHANDLER=1",
        "export PYTHONUNBUFFERED=1",
        f"export OMP_NUM_THREADS={max(1, cfg.slurm.cpus_per_task // per_task)}",
        f"export SLIPWAY_RUN_DIR={shlex.quote(str(paths.path))}",
        'export SLIPWAY_JOB_TAG="$JOB_TAG"',
        *_code_environment(code),
        "# torch's flight recorder: each rank's last collectives, which its hang dump includes",
        "# (trainer/watchdog.py).",
        'export TORCH_FR_BUFFER_SIZE="${TORCH_FR_BUFFER_SIZE:-2000}"',
    ]
    if cfg.slurm.gpus_per_node:
        lines += [
            "# On NCCL a collective that times out dumps it too, into hangs/ (torch appends the rank).",
            "export TORCH_NCCL_DUMP_ON_TIMEOUT=1",
            'export TORCH_FR_DUMP_TEMP_FILE="$HANGS/$JOB_TAG-nccl-trace-rank"',
            'export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$TORCH_FR_DUMP_TEMP_FILE"',
        ]
        if not any(name in cfg.launch.env for name in ALLOC_CONF_NAMES):
            lines += ["# The caching allocator grows its segments: what common/layouts.py's memory estimate assumes.",
                      f'[ -n "${{{ALLOC_CONF_NAMES[0]}:-}}${{{ALLOC_CONF_NAMES[1]}:-}}" ] || '
                      f"export {ALLOC_CONF_NAMES[0]}={ALLOC_CONF}"]
    lines += preflight.environment(cfg)
    if debug:
        lines += ["export CUDA_LAUNCH_BLOCKING=1", "export TORCH_DISTRIBUTED_DEBUG=DETAIL",
                  "export NCCL_DEBUG_SUBSYS=INIT,NET"]
    if (preset := NODE_PRESETS.get(cfg.launch.preset)) is not None:
        lines.append(f"# launch.preset {cfg.launch.preset}: {preset.what}; launch.env overrides any of these.")
        lines += [f"export {key}={shlex.quote(value)}" for key, value in preset.env if key not in cfg.launch.env]
    return lines + [f"export {key}={shell_value(value)}" for key, value in cfg.launch.env.items()]


def _node_helper(cfg: Config) -> list[str]:
    """One task per node beside the training step: the node's heartbeat, and its GPU use for GPU jobs."""
    script = ['n=${SLURMD_NODENAME:-$(hostname)}']
    if cfg.slurm.gpus_per_node:
        script.append('if command -v nvidia-smi >/dev/null; then nvidia-smi dmon --delay 15 --select pumt --options DT '
                      '--filename "$2/$n.gutil" & fi')
    script.append(f'while :; do {{ date --iso-8601=seconds > "$1/$n"; }} 2>/dev/null; '
                  f'sleep {NODE_HEARTBEAT_SECONDS}; done')
    what = "its heartbeat (heartbeats/NODE)" + (" and GPU use (gutil/NODE.gutil)" if cfg.slurm.gpus_per_node else "")
    return [
        f"# On every node: {what}, for `slipway watch`; quiet, as the trap ends it.",
        words(srun_argv(nodes=cfg.slurm.nodes, cpus_per_task=1, overlap=True,
                         extra=["bash", "-c", "; ".join(script), "slipway-node"])) + ' "$HEARTBEATS" "$GUTIL" > /dev/null 2>&1 &',
        'HELPER_PIDS+=("$!")',
    ]


# The steps' named pyxis container (pyxis_lib.sh container_name). no_exec: a step never joins
# another job's running container, it only shares its unpacked filesystem.
PYXIS_PREFIX = "slipway-"
PYXIS_CONTAINER = "${CONTAINER_NAME}:no_exec"


def _settings(cfg: Config, paths: RunDir, env: Environment, container_named: bool, pins: Pins) -> list[str]:
    q = shlex.quote
    s = cfg.slurm
    lines = [
        "# This run's settings (from its config.yaml), read by the job library below, and where its",
        "# files are (common/rundir.py RunDir): the library names no other path.",
        *_path_settings(cfg, paths),
        f"NODES_NEEDED={s.nodes} PROCS_PER_NODE={cfg.launch.procs_per_node} RANKS={cfg.world_size}",
        f"REQUEUE={int(s.requeue)} MAX_RETRIES={s.max_retries} MAX_REQUEUES={s.max_requeues}",
        "# `slipway run` runs this script inside an allocation: nothing there is ever requeued.",
        "NO_REQUEUE='slurm.requeue is off'",
        '[ -z "${SLIPWAY_IN_ALLOCATION:-}" ] || REQUEUE=0 NO_REQUEUE=\'slipway run: not requeued, run it again to resume\'',
        f"PREFLIGHT_TIMEOUT={s.preflight_timeout}",
        f"PREFLIGHT_EXIT={PREFLIGHT_EXIT} HANG_EXIT={HANG_EXIT} REQUEUE_EXIT={REQUEUE_EXIT} "
        f"BAD_INPUT_EXIT={BAD_INPUT_EXIT} CANCEL_EXIT={CANCEL_EXIT} TERM_EXIT={TERM_EXIT}",
        f"STEP_STOP_WAIT={STEP_STOP_WAIT}",
        f"OOM_HINT={q(smaller_batch_hint(cfg))}",
        *bad_nodes_settings(cfg, paths.path.parent),
        *_lead_settings(cfg),
    ]
    empty = "''"
    if env.runtime == "pyxis":
        prefix = PYXIS_PREFIX + (f"{pins.project}-" if pins.project else "")  # only this project's are swept
        lines += [
            "# The steps' named pyxis container (none when CONTAINER_PREFIX is empty): the image build's,",
            "# kept on the nodes for later jobs (CONTAINER_BUILD, container.keep_builds), else this attempt's.",
            f"CONTAINER_PREFIX={prefix if container_named else empty} "
            f"CONTAINER_BUILD={(pins.build if container_named and pins.build else empty)} "
            f"KEEP_BUILDS={cfg.container.keep_builds} IMAGE_IDENTITY={q(pins.image_identity or '')}",
            f"CONTAINER_REMOVE_WAIT={CONTAINER_REMOVE_WAIT} CANCEL_REMOVE_WAIT={CANCEL_REMOVE_WAIT} "
            f"STALE_REMOVE_TIMEOUT={STALE_REMOVE_TIMEOUT}",
        ]
    code = pins.code
    lines += [
        "# What this job runs, pinned at submission: every node checks it before anything starts there",
        "# (verify_nodes), and the libraries are checked before they are sourced.",
        f"CODE_DIR={q(code.dir) if code else empty} CODE_SHA256={code.hash if code else empty}",
    ]
    if pins.image_file:
        lines.append(f"IMAGE_FILE={q(pins.image_file)} IMAGE_SHA256={pins.image_sha256 or empty} "
                     f"IMAGE_SIZE={pins.image_size} IMAGE_MTIME={pins.image_mtime}")
    return lines


WARNING_POLL = 30  # seconds between the warning timer's readings of the run's saves


def _lead_settings(cfg: Config) -> list[str]:
    """The warning lead's terms (requeue_lib.sh warning_lead), unless slurm.signal_seconds fixes it."""
    bounds = cfg.slurm.warning_bounds()
    if bounds is None:
        return ["LEAD_AUTO=0  # the time-limit warning is Slurm's own (#SBATCH --signal), fixed"]
    floor, default, ceiling = bounds
    return ["# The time-limit warning's lead, measured from the run's saves (warning_lead), within these bounds.",
            f"LEAD_AUTO=1 LEAD_MIN={floor} LEAD_DEFAULT={default} LEAD_MAX={ceiling} WARNING_POLL={WARNING_POLL}",
            f"CHECKPOINT_BYTES={checkpoint_bytes(cfg.model.num_params())} SYNC_STEPS={cfg.logging.interval}"]


def _path_settings(cfg: Config, paths: RunDir) -> list[str]:
    """RUN_DIR and the run's other paths (`RunDir.shell_paths`), those inside it relative to it."""
    words = []
    for name, path in paths.shell_paths(cfg.checkpoint.dir).items():
        inside = name != "RUN_DIR" and path.is_relative_to(paths.path)
        words.append(f'{name}="$RUN_DIR"/{shlex.quote(path.relative_to(paths.path).as_posix())}' if inside
                     else f"{name}={shlex.quote(str(path))}")
    return [words[0], " ".join(words[1:6]), " ".join(words[6:])]


def _sourced(paths: RunDir, libs: dict[Path, str]) -> list[str]:
    """Each pinned library checked, then sourced: a copy changed or missing ends the job (said in
    events.log by hand, as the library that would say it is the one in doubt)."""
    return [
        f"# The job library (jobs/slurm/{', '.join(p.name.rsplit('-', 1)[0] + '.sh' for p in libs)}), as submitted: "
        "checked, then sourced.",
        "pinned() {",
        '  if ! printf \'%s  %s\\n\' "$2" "$1" | sha256sum --check --status 2>/dev/null; then',
        '    printf \'%s job %s %s\\n\' "$(date --iso-8601=seconds)" "${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID}" \\',
        '      "verification failed: $1 is not the job library submitted (missing or changed): submit again" \\',
        '      "$(date --iso-8601=seconds)" "${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID}" "end exit $BAD_INPUT_EXIT" >> "$EVENTS_LOG"',
        '    exit "$BAD_INPUT_EXIT"',
        "  fi",
        '  source "$1"',
        "}",
        *(f'pinned "$RUN_DIR"/{shlex.quote(path.relative_to(paths.path).as_posix())} '
          f"{hashlib.sha256(text.encode()).hexdigest()}" for path, text in libs.items()),
    ]


def render_sbatch(cfg: Config, paths: RunDir, env: Environment, pins: Pins = Pins(), exclude: Sequence[str] = (),
                  warm: Optional[warm_ranks.WarmPlan] = None) -> str:
    """The whole batch script for `cfg`, reading and writing only inside `paths.path` (and the
    cluster's remembered bad nodes beside it); `exclude`: those bad nodes (jobs/slurm/bad_nodes.py)."""
    container, prefix = container_args(env, paths)
    # Under pyxis every srun step unpacks the image into a container of its own, unless the
    # steps name one: the preflight's steps then create it and training starts in it at once.
    shared = env.runtime == "pyxis" and cfg.slurm.preflight and not cfg.launch.command
    if shared:
        container.append(Value("--container-name=" + PYXIS_CONTAINER))
    lines = sbatch_header(cfg, paths, exclude) + ["", "set -euo pipefail", *(["set -x"] if cfg.launch.debug else [])]
    pyxis, code = env.runtime == "pyxis", pins.code
    lines += ["", *_settings(cfg, paths, env, shared, pins), *warm_ranks.settings(warm, cfg, paths), "",
              *_sourced(paths, library_files(env, paths)),
              *warm_ranks.start_function(cfg, paths, warm, PYXIS_CONTAINER if shared else None), "",
              *_plot_curves(cfg, paths, container, prefix),
              *_main_start(cfg, paths, code, pyxis, warm is not None)]
    if cfg.launch.pre_launch:
        lines += ["", "# Pre-launch commands from launch.pre_launch (run as written, on the first node).",
                  *cfg.launch.pre_launch]
    lines += preflight.steps(cfg, paths, container, prefix, warm is not None)
    lines += [
        "",
        "# The training step, in the background so the signal traps run at once; each task reports",
        "# its exit into SLIPWAY_EXITS, from which step_exit decides the step's.",
        'export SLIPWAY_EXITS="$EXITS/$JOB_TAG"  # read once below, then removed',
        'rm -rf "$SLIPWAY_EXITS"; mkdir -p "$SLIPWAY_EXITS"',
        "# The time-limit warning as early as the run's saves need (warning_timer), unless fixed.",
        '[ "${LEAD_AUTO:-0}" != 1 ] || { warning_timer > /dev/null 2>&1 & HELPER_PIDS+=("$!"); }',
        launch_line(cfg, paths, container, prefix, code=code, warm=warm is not None) + " &",
        'SRUN_PID=$!',
        'set +e; wait_step "$SRUN_PID"; set -e',
        'step_exit "$STEP_RC" "$SLIPWAY_EXITS"; rc=$STEP_EXIT',
        'OOM_NODES=$(cat "$SLIPWAY_EXITS"/oom-* 2>/dev/null | sort -u | paste -sd " " - || true)',
        f'PREFLIGHT_FAILURE=$(cat "$SLIPWAY_EXITS/{PREFLIGHT_FAILED_FILE}" 2>/dev/null || true); rm -rf "$SLIPWAY_EXITS"',
        'after_preflight "$PREFLIGHT_FAILURE"',
        'after_rank_failure "$rc"',
        'after_oom "$rc"',
        "after_hang",
        'after_stop_request "$rc"',
        'after_node_failure "$rc"',
        '[ "$rc" != 0 ] || TRAINED=1  # on_exit draws the curves, once the end is recorded',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def _main_start(cfg: Config, paths: RunDir, code: Optional[CodeSnapshot], pyxis: bool, warm: bool) -> list[str]:
    return [
        "# ---- main: this job, from its start to its end ----",
        f"cd {shlex.quote(str(paths.project))}",
        'mkdir -p "$LOGS" "$GUTIL" "$HEARTBEATS" "$HANGS"',
        'rm -f "$STOP_FILE"',
        "# What this job (its id survives requeues) has used: failure retries, time-limit requeues;",
        "# and the preemptions (requeues by Slurm), counted apart.",
        "RETRIES=$(count_events retry) REQUEUES=$(count_events time-limit requeue) PREEMPTIONS=$(count_events preempted:)",
        "note_preemption",
        "JOB_TAG=$(job_tag)",
        *(["CONTAINER_NAME=$(container_name)"] if pyxis else []),
        'NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd " " -)',
        'event "start on $SLURM_JOB_NODELIST (restart ${SLURM_RESTART_COUNT:-0}), failure retries '
        '$RETRIES/$MAX_RETRIES, time-limit requeues $REQUEUES/$MAX_REQUEUES$PREEMPTIONS_SAID"',
        *(["keep_container"] if pyxis else []),
        "",
        *_environment(cfg, paths, code),
        "",
        "# Background helpers, ended by the trap whatever happens.",
        'HELPER_PIDS=() SRUN_PID="" STOP_REQUESTED=0 TRAPPED=0',
        "trap on_exit EXIT",
        "trap on_warning USR1",
        "trap on_cancel USR2",
        "trap on_term TERM",
        "trap on_interrupt INT",
        f'( while sleep {HEARTBEAT_SECONDS}; do date --iso-8601=seconds > "$HEARTBEAT"; done ) &',
        'HELPER_PIDS+=("$!")',
        'date --iso-8601=seconds > "$HEARTBEAT"',
        *_node_helper(cfg),
        "# Every node checks the code and image against what was submitted" +
        (", and readies the build's kept container." if pyxis else "."),
        "verify_nodes",
        *(["warm_up"] if warm else []),
        *(["remove_stale_containers"] if pyxis else []),
    ]


def _plot_curves(cfg: Config, paths: RunDir, container: list[str], prefix: str) -> list[str]:
    """plot_curves, which on_exit calls once a job that trained all its steps has recorded its end: a
    bounded step of trainer/plot.py, whose line (the path, or why not) is said, never srun's words."""
    if cfg.launch.command:  # the image may hold no slipway trainer
        return []
    srun = srun_argv(nodes=1, ntasks=1, cpus_per_task=1, container=container)
    plot = [cfg.launch.python, "-m", "trainer.plot", str(paths.path)]
    return ["# The run's curves once it has trained all its steps (on_exit, after the end is recorded).",
            f'plot_curves() {{ echo "curves: $({prefix}timeout 60 {words(srun)} {words(plot)} 2>&1 | grep -v "^srun: " | tail -n 1)"; }}',
            ""]


def render_prepare_sbatch(cfg: Config, paths: RunDir, env: Environment) -> str:
    """The run's data preparation job: `python -m trainer.prepare` in one task, no GPU, in the run's container."""
    s = cfg.slurm
    cpus = s.prepare_cpus or s.cpus_per_task
    opts = [f"--job-name={cfg.run.name}-prepare", "--nodes=1", "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
            f"--time={s.prepare_time}", *_allocation(cfg, partition=s.prepare_partition or s.partition),
            f"--output={sbatch_quote(str(paths.logs / 'prepare-%j.out'))}", "--open-mode=append",
            "--no-requeue"]
    container, prefix = container_args(env, paths)
    srun = srun_argv(nodes=1, ntasks=1, cpus_per_task=cpus, container=container)
    argv = [cfg.launch.python, "-m", "trainer.prepare", "--config", str(paths.config), "--cpus", str(cpus)]
    return "\n".join([
        "#!/bin/bash", f"# slipway data preparation for run {cfg.run.name}: generated, edit configs/ instead",
        *(f"#SBATCH {o}" for o in opts),
        "",
        "set -euo pipefail",
        f"RUN_DIR={shlex.quote(str(paths.path))} EVENTS_LOG={shlex.quote(str(paths.events))}",
        f"cd {shlex.quote(str(paths.project))}",
        EVENT_WRITER,
        'trap \'event "prepare end exit $?"\' EXIT',
        'event "prepare start on $SLURM_JOB_NODELIST"',
        _hf_home(cfg, paths),
        "export PYTHONUNBUFFERED=1",
        "",
        f"{prefix}{words(srun)} \\\n  {words(argv)}",
        "",
    ])
