"""The batch script: one pure render function for every runtime and launcher.

Every config value that reaches the script goes through `shlex.quote` (or
`shell_value`, which keeps `${VAR}` references and quotes everything else), so
no run name, path or env value can ever run a command.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from edf import Environment, srun_flags
from common.secrets import refusal
from jobs.config import NODE_PRESETS, Config
from jobs.slurm.client import srun_argv
from common.errors import ConfigError
from common.rundir import (BAD_INPUT_EXIT, HANG_EXIT, HANGS_DIR, PREFLIGHT_ENV, PREFLIGHT_EXIT, PREFLIGHT_FAILED_FILE,
                           REQUEUE_EXIT, STOP_FILE, CodeSnapshot)
from common.layouts import smaller_batch_hint
from common.layouts import checkpoint_bytes

HEARTBEAT_SECONDS = 60
NODE_HEARTBEAT_SECONDS = 15  # heartbeats/NODE, which `slipway watch` shows by age
# `${VAR}` or `${VAR:-default}` with a default that is literal inside double quotes.
_VAR = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(:-[A-Za-z0-9_./:@%+=, -]*)?\}")


def shell_value(text: str) -> str:
    """Quote `text` for bash, keeping `${VAR}` and `${VAR:-default}` as expansions.

    Only those two forms expand (a default only of characters that are literal
    in double quotes); `$(...)`, backticks and everything else stay literal.
    """
    if "\n" in text or "\0" in text:
        raise ConfigError("", f"value {text!r} contains a newline or NUL, which cannot be passed safely")
    parts, pos = [], 0
    for m in _VAR.finditer(text):
        if m.start() > pos:
            parts.append(shlex.quote(text[pos:m.start()]))
        parts.append(f'"{m.group(0)}"')
        pos = m.end()
    if pos < len(text) or not parts:
        parts.append(shlex.quote(text[pos:]))
    return "".join(parts)


def sbatch_quote(value: str) -> str:
    """A value for an `#SBATCH` line: sbatch splits those lines itself (not a shell),
    honouring double quotes and backslash escapes."""
    if "\n" in value:
        raise ConfigError("", f"value {value!r} contains a newline and cannot go into an #SBATCH line")
    if re.fullmatch(r"[A-Za-z0-9_.,:@%/+=-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class RunPaths:
    """Absolute paths the script needs; fixed before submission."""

    run_dir: Path
    project_dir: Path

    @property
    def config(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def env_toml(self) -> Path:
        return self.run_dir / "env.toml"

    @property
    def script(self) -> Path:
        return self.run_dir / "job.sbatch"


def task_command(cfg: Config, paths: RunPaths, code: Optional[CodeSnapshot] = None) -> list[str]:
    """What each rank runs: the trainer, a custom training script (the code snapshot's copy), or
    `launch.command`."""
    if cfg.launch.command:
        return list(cfg.launch.command)
    if cfg.train.script:
        script = Path(code.script) if code and code.script else Path(cfg.train.script)
        if not script.is_absolute():
            script = paths.project_dir / script
        return [cfg.launch.python, str(script), "--config", str(paths.config)]
    return [cfg.launch.python, "-m", "trainer", "--config", str(paths.config)]


def torchrun_argv(cfg: Config, *, nnodes: str, rdzv: list[str]) -> list[str]:
    """`python -m torch.distributed.run` (an absolute interpreter: the image's PATH may not
    reach srun, see pyxis), then the task command without its interpreter. With a node preset
    each worker is bound to the NUMA node of its GPU (its own Grace on a GH200)."""
    binding = ["--numa-binding=node"] if cfg.binds_numa else []
    return [cfg.launch.python, "-m", "torch.distributed.run", _Expand(f"--nnodes={nnodes}") if "$" in nnodes else f"--nnodes={nnodes}",
            f"--nproc-per-node={cfg.launch.procs_per_node}", *rdzv, *binding, "--max-restarts=0"]


def local_argv(cfg: Config, paths: RunPaths, code: Optional[CodeSnapshot] = None) -> list[str]:
    """The same launch as on the cluster, on this machine: `torchrun --standalone`."""
    cmd = task_command(cfg, paths, code)
    if cfg.launch.procs_per_node == 1 and cfg.slurm.nodes == 1:
        return cmd
    if cmd[0] != cfg.launch.python:
        raise ConfigError("launch.command", "a custom command cannot be spread over processes by torchrun; "
                                            "start it with launch.python or set launch.procs_per_node: 1")
    return torchrun_argv(cfg, nnodes="1", rdzv=["--standalone"]) + cmd[1:]


def _allocation(cfg: Config, *, partition: str | None) -> list[str]:
    """The #SBATCH options every job of a run shares: account, partition, QOS, memory, mail."""
    s = cfg.slurm
    opts = [f"--{name}={sbatch_quote(value)}" for name, value in
            (("account", s.account), ("partition", partition), ("qos", s.qos), ("mem", s.mem)) if value]
    return opts + ([f"--mail-user={sbatch_quote(s.email)}", "--mail-type=END,FAIL"] if s.email else [])


def _header(cfg: Config, paths: RunPaths) -> list[str]:
    s = cfg.slurm
    tasks = 1 if cfg.launch.launcher == "torchrun" else cfg.launch.procs_per_node
    opts = [f"--job-name={cfg.run.name}", f"--nodes={s.nodes}", f"--ntasks-per-node={tasks}",
            f"--cpus-per-task={s.cpus_per_task}", *([f"--gpus-per-node={s.gpus_per_node}"] if s.gpus_per_node else []),
            f"--time={s.time}", *_allocation(cfg, partition=s.partition)]
    opts += [f"--output={sbatch_quote(str(paths.run_dir / s.output))}",
             f"--error={sbatch_quote(str(paths.run_dir / s.error))}", "--open-mode=append"]
    # B: only the batch shell gets the warning; it tells the trainer through STOP_FILE.
    opts += [f"--signal=B:USR1@{s.warning_seconds()}"] if s.warning_seconds() else []
    opts += ["--requeue" if s.requeue else "--no-requeue", *(sbatch_quote(o) for o in s.extra)]
    return ["#!/bin/bash", f"# slipway run {cfg.run.name}: generated, edit configs/ instead"] + \
        [f"#SBATCH {o}" for o in opts]


def _hf_home(cfg: Config, paths: RunPaths) -> str:
    """The user's HF_HOME wins over the project's cache; a config value wins over both."""
    if cfg.launch.hf_home:
        return f"export HF_HOME={shell_value(cfg.launch.hf_home)}"
    return f'[ -n "${{HF_HOME:-}}" ] || export HF_HOME={shlex.quote(str(paths.project_dir / ".cache" / "huggingface"))}'


# The job library (jobs/slurm/job_lib.sh: the job's decisions) and its pyxis part (pyxis_lib.sh:
# named containers), pinned into each run directory by their hash (`library_files`) and sourced by
# job.sbatch once that hash is checked.
JOB_LIB = (Path(__file__).with_name("job_lib.sh")).read_text()
PYXIS_LIB = (Path(__file__).with_name("pyxis_lib.sh")).read_text()
EVENT_WRITER = next(line for line in JOB_LIB.splitlines() if line.startswith("event() "))
LIB_DIR = "lib"


def library_files(env: Environment) -> dict[str, str]:
    """The libraries a job of `env`'s runtime sources, by their place in the run directory
    (lib/NAME-HASH12.sh: a new text is a new file, never an old one rewritten)."""
    libs = [("job_lib", JOB_LIB)] + ([("pyxis_lib", PYXIS_LIB)] if env.runtime == "pyxis" else [])
    return {f"{LIB_DIR}/{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.sh": text for name, text in libs}


@dataclass(frozen=True)
class Pins:
    """What a job runs, pinned at submission, which every node checks before training
    (job_lib.sh verify_nodes): the code snapshot, the squashfs file (none for a registry
    image), and the key of the image build whose unpacked container pyxis keeps on the nodes
    (`jobs.runs.container.kept_build`; None: each attempt unpacks its own)."""

    code: Optional[CodeSnapshot] = None
    image_file: Optional[str] = None
    image_sha256: Optional[str] = None  # of its bytes, where the submission knew it
    image_size: Optional[int] = None
    image_mtime: Optional[int] = None  # seconds, as stat -c %Y gives them
    image_identity: Optional[str] = None  # what the kept container is of: the build hash or the bytes'
    build: Optional[str] = None
# A stopped step and a container removal at the job's end wait at most this long (on_exit);
# the background removal of stale containers at its start, at most STALE_REMOVE_TIMEOUT.
STEP_STOP_WAIT = 30
CONTAINER_REMOVE_WAIT = 5
# After `slipway cancel` (which waits CANCEL_GRACE_SECONDS, 90, for the job) the removal gets longer:
# measured on the real pyxis, a loaded node needs more than CONTAINER_REMOVE_WAIT.
CANCEL_REMOVE_WAIT = 45
STALE_REMOVE_TIMEOUT = 600


def _code_environment(code: Optional[CodeSnapshot]) -> list[str]:
    if code is None:
        return ["# code.snapshot: false: the ranks run the code installed where they run (the image's)."]
    return [f"# The run's code: snapshot {code.hash12} (jobs/runs/code.py), in front of any installed trainer;",
            "# containers get the same by their environment (env.toml / --container-env) and a mount.",
            f"export SLIPWAY_CODE={shlex.quote(code.dir)}",
            f'export PYTHONPATH={shlex.quote(code.environment()["PYTHONPATH"])}"${{PYTHONPATH:+:$PYTHONPATH}}"',
            "export PYTHONSAFEPATH=1"]


def _environment(cfg: Config, paths: RunPaths, code: Optional[CodeSnapshot] = None) -> list[str]:
    debug, hf_home = cfg.launch.debug, _hf_home(cfg, paths)
    per_task = cfg.launch.procs_per_node if cfg.launch.launcher == "torchrun" else 1  # processes sharing its CPUs
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
        f"export SLIPWAY_RUN_DIR={shlex.quote(str(paths.run_dir))}",
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
            f'export TORCH_FR_DUMP_TEMP_FILE="$RUN_DIR/{HANGS_DIR}/$JOB_TAG-nccl-trace-rank"',
            'export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$TORCH_FR_DUMP_TEMP_FILE"',
        ]
    if _preflight_where(cfg) == "step":
        lines += [
            "# The preflight's all-reduce forms a group of its own, on the next free port.",
            "PREFLIGHT_PORT=$(( MASTER_PORT + 1 ))",
            'while (exec 3<>"/dev/tcp/$MASTER_ADDR/$PREFLIGHT_PORT") 2>/dev/null; do '
            "PREFLIGHT_PORT=$(( PREFLIGHT_PORT + 1 )); done",
        ]
    elif _preflight_where(cfg) == "training":
        lines += [
            "# The preflight's all-reduce (MiB, seconds): the training step's first collective",
            "# (trainer/preflight.py AllReduceGate); after_preflight reads a failure.",
            f"export {PREFLIGHT_ENV}={shlex.quote(f'{_preflight_megabytes(cfg)} {cfg.slurm.preflight_timeout}')}",
        ]
    if debug:
        lines += ["export CUDA_LAUNCH_BLOCKING=1", "export TORCH_DISTRIBUTED_DEBUG=DETAIL",
                  "export NCCL_DEBUG_SUBSYS=INIT,NET"]
    preset = NODE_PRESETS.get(cfg.launch.preset)
    if preset is not None:
        lines.append(f"# launch.preset {cfg.launch.preset}: {preset.what}; launch.env overrides any of these.")
        lines += [f"export {key}={shlex.quote(value)}" for key, value in preset.env if key not in cfg.launch.env]
    for key, value in cfg.launch.env.items():
        lines.append(f"export {key}={shell_value(value)}")
    return lines


def check_env_from_host(cfg: Config, environ: dict[str, str] | None = None) -> None:
    """At submission: every `container.env_from_host` variable is set here, and sbatch hands it
    to the job. The job takes these variables from the environment sbatch exports (its default,
    --export=ALL; the batch script's sruns keep it); an --export that leaves one out (slurm.extra,
    or $SBATCH_EXPORT, which outranks #SBATCH lines) would start the job without it."""
    environ = dict(os.environ) if environ is None else environ
    names = cfg.container.env_from_host
    cfg.container.require_host_env(environ)
    exports = [(f"slurm.extra[{i}]", opt.split("=", 1)[1]) for i, opt in enumerate(cfg.slurm.extra)
               if opt.startswith("--export=")]
    if "SBATCH_EXPORT" in environ:
        exports.append(("SBATCH_EXPORT", environ["SBATCH_EXPORT"]))
    for where, value in exports:
        listed = [v.split("=", 1)[0] for v in value.split(",")]
        for item, name in zip(value.split(","), listed):  # slurm.extra's were refused as the config was read
            found = refusal(item.split("=", 1)[1], name=name) if "=" in item else None
            if found is not None:
                raise ConfigError(where, found.message())
        dropped = [n for n in names if "ALL" not in listed and n not in listed]
        if dropped:  # the names alone are shown: an --export may hold NAME=value pairs
            raise ConfigError(where, f"an --export that names {', '.join(listed)} does not pass "
                                     f"{', '.join(dropped)} (container.env_from_host) to the job: use --export=ALL, "
                                     f"or add {dropped[0]} to it")


class _Expand(str):
    """A word of our own making that bash must expand (`$MASTER_ADDR`...): double-quoted."""


class _Value(str):
    """A config value in which `${VAR}` expands and nothing else: `shell_value`."""


def _words(argv: list[str]) -> str:
    return " ".join(f'"{a}"' if isinstance(a, _Expand) else shell_value(a) if isinstance(a, _Value)
                    else shlex.quote(a) for a in argv)


def _container_args(env: Environment, paths: RunPaths) -> tuple[list[str], str]:
    """(srun arguments, the `NAME=value ` words that set variables for the srun line alone).

    pyxis's --container-env passes the [env] values from srun's environment: they are set
    for the srun alone so the host commands of the script keep their own (PATH...)."""
    flags = srun_flags(env, paths.env_toml)
    return [_Value(a) for a in flags.args], "".join(f"{name}={shell_value(value)} " for name, value in flags.exports)


def _launch(cfg: Config, paths: RunPaths, container: list[str], prefix: str,
            cmd: list[str] | None = None, port: str = "MASTER_PORT", wrap: list[str] = (),
            code: Optional[CodeSnapshot] = None) -> str:
    """The `srun` line that starts every rank: the trainer, or `cmd` (the preflight's all-reduce)
    launched the same way with its rendezvous on `$port`, as a step bounded by the words `wrap`
    (`timeout ...`), whose ranks end together (no --wait); not backgrounded. The training
    step's tasks report their exits into $SLIPWAY_EXITS."""
    report = cmd is None
    cmd = task_command(cfg, paths, code) if cmd is None else cmd
    torchrun = cfg.launch.launcher == "torchrun"
    # A node preset's srun launcher runs one task per GPU, on the cores and memory next to it:
    # task i gets GPU i and cores [i * cpus_per_task, (i + 1) * cpus_per_task), on a GH200 its own Grace.
    srun = [*wrap, *srun_argv(nodes=cfg.slurm.nodes, ntasks_per_node=1 if torchrun else cfg.launch.procs_per_node,
                              cpus_per_task=cfg.slurm.cpus_per_task, kill_on_bad_exit=True, wait=None if wrap else 60,
                              near_gpu=not torchrun and cfg.launch.preset in NODE_PRESETS, container=container)]
    if torchrun:
        if cmd[0] != cfg.launch.python:
            raise ConfigError("launch.command", "with launcher torchrun the command must start with launch.python "
                                                f"({cfg.launch.python}); use launcher srun for other programs")
        rdzv = [_Expand(f"--rdzv-endpoint=$MASTER_ADDR:${port}"), _Expand("--rdzv-id=$SLURM_JOB_ID"),
                "--rdzv-backend=c10d"]
        argv = torchrun_argv(cfg, nnodes=_Expand("$SLURM_NNODES"), rdzv=rdzv) + cmd[1:]
        argv = ["bash", "-c", REPORT_EXIT, "slipway-task", *argv] if report else argv
    else:  # one task per process: the rank variables come from Slurm's own
        mapper = ('export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS '
                  'LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE NODE_RANK=$SLURM_NODEID; ')
        argv = ["bash", "-c", mapper + (REPORT_EXIT if report else 'exec "$@"'), "slipway-task", *cmd]
        if port != "MASTER_PORT":  # init_process_group reads MASTER_PORT: this launch's own, for its srun alone
            prefix += f'MASTER_PORT="${port}" '
    return f"{prefix}{_words(srun)} \\\n  {_words(argv)}"


# Each task of the training step reports its own exit (step_exit in jobs/slurm/job_lib.sh): a task
# that Slurm kills reports nothing, its wrapper dying with it. A failed task during which its
# node's out-of-memory killer ran (/proc/vmstat's oom_kill moved) names the node too (after_oom).
REPORT_EXIT = ('o=$(grep -s "^oom_kill " /proc/vmstat); "$@"; rc=$?; echo "$rc" > "$SLIPWAY_EXITS/$SLURM_PROCID" '
                '2>/dev/null; [ "$rc" = 0 ] || [ "$(grep -s "^oom_kill " /proc/vmstat)" = "$o" ] || echo '
                '"${SLURMD_NODENAME:-$(hostname)}" > "$SLIPWAY_EXITS/oom-$SLURM_PROCID" 2>/dev/null; exit "$rc"')


def _node_helper(cfg: Config) -> list[str]:
    """One task per node beside the training step: the node's heartbeat, and its GPU use for GPU jobs."""
    script = ['n=${SLURMD_NODENAME:-$(hostname)}']
    if cfg.slurm.gpus_per_node:
        script.append('if command -v nvidia-smi >/dev/null; then nvidia-smi dmon --delay 15 --select pumt --options DT '
                      '--filename "$1/gutil/$n.gutil" & fi')
    script.append(f'while :; do {{ date --iso-8601=seconds > "$1/heartbeats/$n"; }} 2>/dev/null; '
                  f'sleep {NODE_HEARTBEAT_SECONDS}; done')
    what = "its heartbeat (heartbeats/NODE)" + (" and GPU use (gutil/NODE.gutil)" if cfg.slurm.gpus_per_node else "")
    return [
        f"# On every node: {what}, for `slipway watch`; quiet, as the trap ends it.",
        _words(srun_argv(nodes=cfg.slurm.nodes, cpus_per_task=1, overlap=True,
                         extra=["bash", "-c", "; ".join(script), "slipway-node"])) + ' "$RUN_DIR" > /dev/null 2>&1 &',
        'HELPER_PIDS+=("$!")',
    ]


# The steps' named pyxis container: CONTAINER_NAME (job_lib.sh's container_name: the image
# build's kept one, or this attempt's own). no_exec: a step never joins another job's running
# container, it only shares its unpacked filesystem.
PYXIS_PREFIX = "slipway-"
PYXIS_CONTAINER = "${CONTAINER_NAME}:no_exec"


def _preflight_where(cfg: Config) -> Optional[str]:
    """Where the preflight's all-reduce runs: "training" (slipway's trainer runs it first in its
    own process group, saving a torch start and a rendezvous per rank), "step" (a train.script of
    the user's: a step of its own before training), None (no preflight: off, or launch.command,
    whose image may not hold slipway's trainer)."""
    if not cfg.slurm.preflight or cfg.launch.command:
        return None
    return "step" if cfg.train.script else "training"


def _preflight_megabytes(cfg: Config) -> int:
    return 64 if cfg.slurm.gpus_per_node else 4


def _preflight(cfg: Config, paths: RunPaths, container: list[str], prefix: str) -> list[str]:
    """The preflight (trainer/preflight.py): each node's checks, then an all-reduce across every
    rank, in a step of its own for a train.script (else in the training step)."""
    s = cfg.slurm
    where = _preflight_where(cfg)
    if where is None:
        return []
    limit = ["timeout", "-k", "15", str(s.preflight_timeout)]
    checkpoint_dir = paths.run_dir / cfg.checkpoint.dir
    # --kill-on-bad-exit=0: a node that fails fast must not cut the other nodes' reports short
    # (where the cluster sets KillOnBadExit=1), or they would be blamed for sending none.
    node_srun = [*limit, *srun_argv(nodes=s.nodes, cpus_per_task=s.cpus_per_task, kill_on_bad_exit=False,
                                    container=container)]
    node_cmd = [cfg.launch.python, "-m", "trainer.preflight", "node", "--run-dir", str(paths.run_dir),
                "--checkpoint-dir", str(checkpoint_dir),
                "--checkpoint-bytes", str(checkpoint_bytes(cfg.model.num_params())), "--gpus", str(s.gpus_per_node),
                *(["--numa-binding"] if cfg.binds_numa else [])]
    allreduce = [cfg.launch.python, "-m", "trainer.preflight", "allreduce", "--megabytes",
                 str(_preflight_megabytes(cfg)), "--timeout", str(s.preflight_timeout)]
    lines = [
        "",
        "# Preflight (trainer/preflight.py), each part at most slurm.preflight_timeout: every node checks",
        "# the run directory, free space and its GPUs, reporting on its own; a node that fails or sends",
        "# no report is named and the job retried without it. Then every rank joins a short all-reduce",
        "# (" + ("in a step of its own: the ranks run a train.script" if where == "step" else
                 "the training step's first collective") + ").",
        'PREFLIGHT_LOG="$RUN_DIR/logs/preflight-$JOB_TAG.out"',
        f'set +e; {prefix}{_words(node_srun)} \\\n  {_words(node_cmd)} > "$PREFLIGHT_LOG" 2>&1',
        'pf_rc=$?; set -e; cat "$PREFLIGHT_LOG"',
        'preflight_nodes "$PREFLIGHT_LOG" "$pf_rc"',
    ]
    if where != "step":
        return lines
    return lines + [
        'PREFLIGHT_LOG="$RUN_DIR/logs/preflight-$JOB_TAG-allreduce.out"',
        "set +e; " + _launch(cfg, paths, container, prefix, cmd=allreduce, port="PREFLIGHT_PORT", wrap=limit)
        + ' > "$PREFLIGHT_LOG" 2>&1',
        'pf_rc=$?; set -e; cat "$PREFLIGHT_LOG"',
        'preflight_allreduce "$PREFLIGHT_LOG" "$pf_rc"',
    ]


def _settings(cfg: Config, paths: RunPaths, env: Environment, container_named: bool, pins: Pins) -> list[str]:
    """The run's values, set once: the data the job library's functions decide on."""
    q = shlex.quote
    s = cfg.slurm
    ckpt = Path(cfg.checkpoint.dir)
    checkpoints = q(str(ckpt)) if ckpt.is_absolute() else f'"$RUN_DIR"/{q(str(ckpt))}'
    lines = [
        "# This run's settings (from its config.yaml), read by the job library below.",
        f"RUN_DIR={q(str(paths.run_dir))}",
        f"NODES_NEEDED={s.nodes} PROCS_PER_NODE={cfg.launch.procs_per_node} RANKS={cfg.world_size}",
        f"REQUEUE={int(s.requeue)} MAX_RETRIES={s.max_retries} MAX_REQUEUES={s.max_requeues}",
        "# `slipway run` runs this script inside an allocation: nothing there is ever requeued.",
        "NO_REQUEUE='slurm.requeue is off'",
        '[ -z "${SLIPWAY_IN_ALLOCATION:-}" ] || REQUEUE=0 NO_REQUEUE=\'slipway run: not requeued, run it again to resume\'',
        f"PREFLIGHT_TIMEOUT={s.preflight_timeout}",
        f"PREFLIGHT_EXIT={PREFLIGHT_EXIT} HANG_EXIT={HANG_EXIT} REQUEUE_EXIT={REQUEUE_EXIT} "
        f"BAD_INPUT_EXIT={BAD_INPUT_EXIT}",
        f"CHECKPOINT_DIR={checkpoints}",
        f'HANGS="$RUN_DIR/{HANGS_DIR}" STOP_FILE="$RUN_DIR/{STOP_FILE}" STEP_STOP_WAIT={STEP_STOP_WAIT}',
        f"OOM_HINT={q(smaller_batch_hint(cfg))}",
    ]
    empty = "''"
    if env.runtime == "pyxis":
        lines += [
            "# The steps' named pyxis container (none when CONTAINER_PREFIX is empty): the image build's,",
            "# kept on the nodes for later jobs (CONTAINER_BUILD, container.keep_builds), else this attempt's.",
            f"CONTAINER_PREFIX={PYXIS_PREFIX if container_named else empty} "
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


def _sourced(libs: dict[str, str]) -> list[str]:
    """The lines that check each pinned library's hash and source it: a copy changed or missing
    ends the job before anything runs (exit BAD_INPUT_EXIT, said in events.log by hand, as the
    library that would say it is the one in doubt)."""
    lines = []
    for rel, text in libs.items():
        digest = hashlib.sha256(text.encode()).hexdigest()
        lines.append(f"pinned \"$RUN_DIR\"/{shlex.quote(rel)} {digest}")
    return [
        "# The job library (jobs/slurm/job_lib.sh" + (", pyxis_lib.sh" if len(libs) > 1 else "")
        + "), as submitted: checked, then sourced.",
        "pinned() {",
        '  if ! printf \'%s  %s\\n\' "$2" "$1" | sha256sum --check --status 2>/dev/null; then',
        '    printf \'%s job %s %s\\n\' "$(date --iso-8601=seconds)" "${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID}" \\',
        '      "verification failed: $1 is not the job library submitted (missing or changed): submit again" \\',
        '      "$(date --iso-8601=seconds)" "${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID}" "end exit $BAD_INPUT_EXIT" >> "$RUN_DIR/events.log"',
        '    exit "$BAD_INPUT_EXIT"',
        "  fi",
        '  source "$1"',
        "}",
        *lines,
    ]


def render_sbatch(cfg: Config, paths: RunPaths, env: Environment, pins: Pins = Pins()) -> str:
    """The whole batch script for `cfg`, reading and writing only inside `paths.run_dir`;
    `env` is the run's container environment (`jobs.runs.container.run_environment`), `pins`
    what the job runs (its code snapshot, image and kept container), which it checks on every
    node first. It sources the libraries `library_files(env)` puts in the run directory."""
    container, prefix = _container_args(env, paths)
    # Under pyxis every srun step unpacks the image into a container of its own, unless the
    # steps name one: the preflight's steps then create it and training starts in it at once.
    shared = env.runtime == "pyxis" and cfg.slurm.preflight and not cfg.launch.command
    if shared:
        container.append(_Value("--container-name=" + PYXIS_CONTAINER))
    lines = _header(cfg, paths) + ["", "set -euo pipefail"]
    if cfg.launch.debug:
        lines.append("set -x")
    pyxis, code = env.runtime == "pyxis", pins.code
    lines += ["", *_settings(cfg, paths, env, shared, pins), "", *_sourced(library_files(env)), "",
              *_plot_curves(cfg, paths, container, prefix),
              "# ---- main: this job, from its start to its end ----",
              f"cd {shlex.quote(str(paths.project_dir))}",
              'mkdir -p "$RUN_DIR/logs" "$RUN_DIR/gutil" "$RUN_DIR/heartbeats" "$HANGS"',
              'rm -f "$STOP_FILE"',
              "# What this job (its id survives requeues) has used: failure retries, time-limit requeues.",
              "RETRIES=$(count_events retry) REQUEUES=$(count_events time-limit requeue)",
              "JOB_TAG=$(job_tag)",
              *(["CONTAINER_NAME=$(container_name)"] if pyxis else []),
              'NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd " " -)',
              'event "start on $SLURM_JOB_NODELIST (restart ${SLURM_RESTART_COUNT:-0}), failure retries '
              '$RETRIES/$MAX_RETRIES, time-limit requeues $REQUEUES/$MAX_REQUEUES"',
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
              f'( while sleep {HEARTBEAT_SECONDS}; do date --iso-8601=seconds > "$RUN_DIR/heartbeat"; done ) &',
              'HELPER_PIDS+=("$!")',
              'date --iso-8601=seconds > "$RUN_DIR/heartbeat"',
              *_node_helper(cfg),
              "# Every node checks the code and image against what was submitted" +
              (", and readies the build's kept container." if pyxis else "."),
              "verify_nodes",
              *(["remove_stale_containers"] if pyxis else [])]
    if cfg.launch.pre_launch:
        lines += ["", "# Pre-launch commands from launch.pre_launch (run as written, on the first node)."]
        lines += list(cfg.launch.pre_launch)
    lines += _preflight(cfg, paths, container, prefix)
    lines += [
        "",
        "# The training step, in the background so the signal traps run at once; each task reports",
        "# its exit into SLIPWAY_EXITS, from which step_exit decides the step's.",
        'export SLIPWAY_EXITS="$RUN_DIR/.exits/$JOB_TAG"  # read once below, then removed',
        'rm -rf "$SLIPWAY_EXITS"; mkdir -p "$SLIPWAY_EXITS"',
        _launch(cfg, paths, container, prefix, code=code) + " &",
        'SRUN_PID=$!',
        'set +e; wait_step "$SRUN_PID"; set -e',
        'rc=$(step_exit "$STEP_RC" "$SLIPWAY_EXITS")',
        'OOM_NODES=$(cat "$SLIPWAY_EXITS"/oom-* 2>/dev/null | sort -u | paste -sd " " - || true)',
        f'PREFLIGHT_FAILURE=$(cat "$SLIPWAY_EXITS/{PREFLIGHT_FAILED_FILE}" 2>/dev/null || true); rm -rf "$SLIPWAY_EXITS"',
        'after_preflight "$PREFLIGHT_FAILURE"',
        'after_oom "$rc"',
        "after_hang",
        'after_stop_request "$rc"',
        'after_node_failure "$rc"',
        '[ "$rc" != 0 ] || TRAINED=1  # on_exit draws the curves, once the end is recorded',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def _plot_curves(cfg: Config, paths: RunPaths, container: list[str], prefix: str) -> list[str]:
    """plot_curves, which on_exit (jobs/slurm/job_lib.sh) calls after a job that trained all its
    steps has recorded its end: the run's curves.png from its metrics (trainer/plot.py), as a step
    of one task in the job's container, bounded; without matplotlib in the image it says so."""
    if cfg.launch.command:  # the image may hold no slipway trainer
        return []
    srun = srun_argv(nodes=1, ntasks=1, cpus_per_task=1, container=container)
    plot = [cfg.launch.python, "-m", "trainer.plot", str(paths.run_dir)]
    return ["# The run's curves once it has trained all its steps (on_exit, after the end is recorded).",
            f'plot_curves() {{ echo "curves: $({prefix}timeout 60 {_words(srun)} {_words(plot)} 2>&1 | tail -n 1)"; }}',
            ""]


PREPARE_SCRIPT = "prepare.sbatch"


def render_prepare_sbatch(cfg: Config, paths: RunPaths, env: Environment) -> str:
    """The data preparation job of a run: one task on one node, no GPU, tokenizing the
    run's data into its token cache with `python -m trainer.prepare`, in the run's
    container (the same srun flags as training). Its log goes to logs/prepare-JOB.out."""
    s = cfg.slurm
    cpus = s.prepare_cpus or s.cpus_per_task
    opts = [f"--job-name={cfg.run.name}-prepare", "--nodes=1", "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
            f"--time={s.prepare_time}", *_allocation(cfg, partition=s.prepare_partition or s.partition),
            f"--output={sbatch_quote(str(paths.run_dir / 'logs' / 'prepare-%j.out'))}", "--open-mode=append",
            "--no-requeue"]
    container, prefix = _container_args(env, paths)
    srun = srun_argv(nodes=1, ntasks=1, cpus_per_task=cpus, container=container)
    argv = [cfg.launch.python, "-m", "trainer.prepare", "--config", str(paths.config), "--cpus", str(cpus)]
    return "\n".join([
        "#!/bin/bash", f"# slipway data preparation for run {cfg.run.name}: generated, edit configs/ instead",
        *(f"#SBATCH {o}" for o in opts),
        "",
        "set -euo pipefail",
        f"RUN_DIR={shlex.quote(str(paths.run_dir))}",
        f"cd {shlex.quote(str(paths.project_dir))}",
        EVENT_WRITER,
        'trap \'event "prepare end exit $?"\' EXIT',
        'event "prepare start on $SLURM_JOB_NODELIST"',
        _hf_home(cfg, paths),
        "export PYTHONUNBUFFERED=1",
        "",
        f"{prefix}{_words(srun)} \\\n  {_words(argv)}",
        "",
    ])
