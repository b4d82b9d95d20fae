"""The batch script: one pure render function for every runtime and launcher.

Every config value that reaches the script goes through `shlex.quote` (or
`shell_value`, which keeps `${VAR}` references and quotes everything else), so
no run name, path or env value can ever run a command.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from edf import Environment, srun_flags
from jobs.config import NODE_PRESETS, Config
from trainer.config import REQUEUE_EXIT, STOP_FILE, ConfigError

HEARTBEAT_SECONDS = 60
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


def task_command(cfg: Config, paths: RunPaths) -> list[str]:
    """What each rank runs: the trainer, a custom training script, or `launch.command`."""
    if cfg.launch.command:
        return list(cfg.launch.command)
    if cfg.train.script:
        script = Path(cfg.train.script)
        if not script.is_absolute():
            script = paths.project_dir / script
        return [cfg.launch.python, str(script), "--config", str(paths.config)]
    return [cfg.launch.python, "-m", "trainer", "--config", str(paths.config)]


def torchrun_argv(cfg: Config, *, nnodes: str, rdzv: list[str]) -> list[str]:
    """`python -m torch.distributed.run` (an absolute interpreter: the image's PATH may not
    reach srun, see pyxis), then the task command without its interpreter. With a node preset
    each worker is bound to the NUMA node of its GPU (its own Grace on a GH200)."""
    binding = ["--numa-binding=node"] if cfg.launch.preset in NODE_PRESETS else []
    return [cfg.launch.python, "-m", "torch.distributed.run", _Expand(f"--nnodes={nnodes}") if "$" in nnodes else f"--nnodes={nnodes}",
            f"--nproc-per-node={cfg.launch.procs_per_node}", *rdzv, *binding, "--max-restarts=0"]


def local_argv(cfg: Config, paths: RunPaths) -> list[str]:
    """The same launch as on the cluster, on this machine: `torchrun --standalone`."""
    cmd = task_command(cfg, paths)
    if cfg.launch.procs_per_node == 1 and cfg.slurm.nodes == 1:
        return cmd
    if cmd[0] != cfg.launch.python:
        raise ConfigError("launch.command", "a custom command cannot be spread over processes by torchrun; "
                                            "start it with launch.python or set launch.procs_per_node: 1")
    return torchrun_argv(cfg, nnodes="1", rdzv=["--standalone"]) + cmd[1:]


def _omp_threads(cfg: Config) -> int:
    per_task = cfg.launch.procs_per_node if cfg.launch.launcher == "torchrun" else 1
    return max(1, cfg.slurm.cpus_per_task // per_task)


def _allocation(cfg: Config, *, partition: str | None) -> list[str]:
    """The #SBATCH options every job of a run shares: account, partition, QOS, memory, mail."""
    s = cfg.slurm
    opts = []
    for name, value in (("account", s.account), ("partition", partition), ("qos", s.qos), ("mem", s.mem)):
        if value:
            opts.append(f"--{name}={sbatch_quote(value)}")
    if s.email:
        opts += [f"--mail-user={sbatch_quote(s.email)}", "--mail-type=END,FAIL"]
    return opts


def _header(cfg: Config, paths: RunPaths) -> list[str]:
    s = cfg.slurm
    tasks = 1 if cfg.launch.launcher == "torchrun" else cfg.launch.procs_per_node
    opts = [f"--job-name={cfg.run.name}", f"--nodes={s.nodes}", f"--ntasks-per-node={tasks}",
            f"--cpus-per-task={s.cpus_per_task}"]
    if s.gpus_per_node:
        opts.append(f"--gpus-per-node={s.gpus_per_node}")
    opts.append(f"--time={s.time}")
    opts += _allocation(cfg, partition=s.partition)
    opts += [f"--output={sbatch_quote(str(paths.run_dir / s.output))}",
             f"--error={sbatch_quote(str(paths.run_dir / s.error))}",
             "--open-mode=append"]
    if s.warning_seconds():
        # B: only the batch shell gets it; it tells the trainer through STOP_FILE.
        opts.append(f"--signal=B:USR1@{s.warning_seconds()}")
    opts.append("--requeue" if s.requeue else "--no-requeue")
    opts += [sbatch_quote(o) for o in s.extra]
    return ["#!/bin/bash", f"# slipway run {cfg.run.name}: generated, edit configs/ instead"] + \
        [f"#SBATCH {o}" for o in opts]


def _hf_home(cfg: Config, paths: RunPaths) -> str:
    """The user's HF_HOME wins over the project's cache; a config value wins over both."""
    if cfg.launch.hf_home:
        return f"export HF_HOME={shell_value(cfg.launch.hf_home)}"
    return f'[ -n "${{HF_HOME:-}}" ] || export HF_HOME={shlex.quote(str(paths.project_dir / ".cache" / "huggingface"))}'


_EVENT = ('event() { printf \'%s job %s %s\\n\' "$(date --iso-8601=seconds)" "$SLURM_JOB_ID" "$*" '
          '>> "$RUN_DIR/events.log"; }')


def _environment(cfg: Config, paths: RunPaths) -> list[str]:
    debug = cfg.launch.debug
    hf_home = _hf_home(cfg, paths)
    lines = [
        "# Rendezvous: the first host of the allocation, never `hostname --ip-address`. sed reads",
        "# the whole list: `head` would close the pipe early, and pipefail would kill the script",
        "# with SIGPIPE on large allocations.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        "# A port from the job id, below the ephemeral range, moved on while one is taken.",
        "MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 12000 ))",
        'while (exec 3<>"/dev/tcp/$MASTER_ADDR/$MASTER_PORT") 2>/dev/null; do MASTER_PORT=$(( MASTER_PORT + 1 )); done',
        "export MASTER_ADDR MASTER_PORT",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        hf_home,
        "# Secrets stay in the environment they came from; nothing is written to disk.",
        'if [ -n "${WANDB_API_KEY:-}" ]; then export WANDB_MODE="${WANDB_MODE:-online}"; '
        "else export WANDB_MODE=offline; fi",
        f"export NCCL_DEBUG={'INFO' if debug else '${NCCL_DEBUG:-WARN}'}",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "export PYTHONFAULTHANDLER=1",
        "export PYTHONUNBUFFERED=1",
        f"export OMP_NUM_THREADS={_omp_threads(cfg)}",
        f"export SLIPWAY_RUN_DIR={shlex.quote(str(paths.run_dir))}",
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


class _Expand(str):
    """A word of our own making that bash must expand (`$MASTER_ADDR`...): double-quoted."""


class _Value(str):
    """A config value in which `${VAR}` expands and nothing else: `shell_value`."""


def _words(argv: list[str]) -> str:
    return " ".join(f'"{a}"' if isinstance(a, _Expand) else shell_value(a) if isinstance(a, _Value)
                    else shlex.quote(a) for a in argv)


def _container_args(env: Environment, paths: RunPaths) -> tuple[list[str], list[str]]:
    """(srun arguments, NAME=value words set for the srun line only) for the run's environment.

    pyxis's --container-env passes the [env] values from srun's environment: they are set
    for the srun alone so the host commands of the script keep their own (PATH...)."""
    flags = srun_flags(env, paths.env_toml)
    return [_Value(a) for a in flags.args], [f"{name}={shell_value(value)}" for name, value in flags.exports]


def _launch(cfg: Config, paths: RunPaths, container: list[str], assigns: list[str]) -> str:
    """The `srun` line that starts every rank, backgrounded."""
    cmd = task_command(cfg, paths)
    prefix = "".join(f"{a} " for a in assigns)
    srun = ["srun", "--kill-on-bad-exit=1", "--wait=60", f"--cpus-per-task={cfg.slurm.cpus_per_task}",
            f"--nodes={cfg.slurm.nodes}"]
    if cfg.launch.launcher == "torchrun":
        if cmd[0] != cfg.launch.python:
            raise ConfigError("launch.command", "with launcher torchrun the command must start with launch.python "
                                                f"({cfg.launch.python}); use launcher srun for other programs")
        rdzv = [_Expand("--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT"), _Expand("--rdzv-id=$SLURM_JOB_ID"),
                "--rdzv-backend=c10d"]
        argv = torchrun_argv(cfg, nnodes=_Expand("$SLURM_NNODES"), rdzv=rdzv) + cmd[1:]
        return f"{prefix}{_words(srun + ['--ntasks-per-node=1'] + container)} \\\n  {_words(argv)} &"
    # One task per process: the rank variables come from Slurm's own.
    mapper = ('export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS '
              'LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE NODE_RANK=$SLURM_NODEID; exec "$@"')
    srun += [f"--ntasks-per-node={cfg.launch.procs_per_node}"]
    if cfg.launch.preset in NODE_PRESETS:
        # One task per GPU, on the cores and memory next to it: task i gets GPU i and cores
        # [i * cpus_per_task, (i + 1) * cpus_per_task), which on a GH200 is its own Grace.
        srun += ["--gpus-per-task=1", "--cpu-bind=verbose,cores", "--mem-bind=local"]
    srun += container
    return f"{prefix}{_words(srun)} \\\n  {_words(['bash', '-c', mapper, 'slipway-task', *cmd])} &"


def render_sbatch(cfg: Config, paths: RunPaths, env: Environment) -> str:
    """The whole batch script for `cfg`, reading and writing only inside `paths.run_dir`;
    `env` is the run's container environment (`jobs.container.run_environment`)."""
    q = shlex.quote
    run_dir = q(str(paths.run_dir))
    container, assigns = _container_args(env, paths)
    lines = _header(cfg, paths) + ["", "set -euo pipefail"]
    if cfg.launch.debug:
        lines.append("set -x")
    lines += [
        f"RUN_DIR={run_dir}",
        f"cd {q(str(paths.project_dir))}",
        'mkdir -p "$RUN_DIR/logs" "$RUN_DIR/gutil"',
        'rm -f "$RUN_DIR/' + STOP_FILE + '"',
        _EVENT,
        'event "start on $SLURM_JOB_NODELIST (restart ${SLURM_RESTART_COUNT:-0})"',
        "",
        *_environment(cfg, paths),
        "",
        "# Background helpers, ended by the trap whatever happens.",
        "HELPER_PIDS=()",
        'SRUN_PID=""',
        'STOP_REQUESTED=0 TRAPPED=0',
        "cleanup() {",
        "  rc=$?",
        '  for pid in "${HELPER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done',
        '  event "end exit $rc"',
        "}",
        "trap cleanup EXIT",
        "# Slurm's warning before the time limit: ask the trainer to save at the step boundary.",
        "on_warning() {",
        "  STOP_REQUESTED=1 TRAPPED=1",
        '  event "time limit warning: stop requested"',
        '  touch "$RUN_DIR/' + STOP_FILE + '"',
        "}",
        "trap on_warning USR1",
        f'( while sleep {HEARTBEAT_SECONDS}; do date --iso-8601=seconds > "$RUN_DIR/heartbeat"; done ) &',
        'HELPER_PIDS+=("$!")',
        'date --iso-8601=seconds > "$RUN_DIR/heartbeat"',
    ]
    if cfg.slurm.gpus_per_node:
        monitor = ('command -v nvidia-smi >/dev/null || exit 0; '
                   'exec nvidia-smi dmon --delay 15 --select pumt --options DT --filename "$1/gutil/$(hostname).gutil"')
        lines += [
            "# GPU use per node (power, utilisation, memory, temperature) beside the training step.",
            f"srun --overlap --nodes={cfg.slurm.nodes} --ntasks-per-node=1 --cpus-per-task=1 "
            f"bash -c {q(monitor)} slipway-gutil \"$RUN_DIR\" &",
            'HELPER_PIDS+=("$!")',
        ]
    if cfg.launch.pre_launch:
        lines += ["", "# Pre-launch commands from launch.pre_launch (run as written, on the first node)."]
        lines += list(cfg.launch.pre_launch)
    lines += [
        "",
        "# The training step, in the background so the warning trap runs at once.",
        _launch(cfg, paths, container, assigns),
        'SRUN_PID=$!',
        'set +e',
        '# A trap interrupts `wait`; then wait again for the step itself.',
        'while :; do',
        '  TRAPPED=0',
        '  wait "$SRUN_PID"; rc=$?',
        '  [ "$TRAPPED" = 1 ] || break',
        '  kill -0 "$SRUN_PID" 2>/dev/null && continue',
        '  wait "$SRUN_PID" 2>/dev/null; again=$?; [ "$again" = 127 ] || rc=$again; break',
        'done',
        'set -e',
        f'if [ "$STOP_REQUESTED" = 1 ] || [ "$rc" = {REQUEUE_EXIT} ]; then',
    ]
    if cfg.slurm.requeue:
        limit = cfg.slurm.max_requeues
        lines += [
            f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -ge {limit} ]; then',
            f'    event "saved after stop request (step exit $rc); not requeueing: slurm.max_requeues ({limit}) reached"',
            f"    exit {REQUEUE_EXIT}",
            "  fi",
            '  event "saved after stop request (step exit $rc): requeueing"',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "  exit 0",
        ]
    else:
        lines += ['  event "saved after stop request (step exit $rc); slurm.requeue is off"', f"  exit {REQUEUE_EXIT}"]
    lines += ["fi", 'exit "$rc"', ""]
    return "\n".join(lines)


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
    container, assigns = _container_args(env, paths)
    prefix = "".join(f"{a} " for a in assigns)
    srun = ["srun", "--nodes=1", "--ntasks=1", f"--cpus-per-task={cpus}", *container]
    argv = [cfg.launch.python, "-m", "trainer.prepare", "--config", str(paths.config), "--cpus", str(cpus)]
    lines = ["#!/bin/bash", f"# slipway data preparation for run {cfg.run.name}: generated, edit configs/ instead"]
    lines += [f"#SBATCH {o}" for o in opts]
    lines += [
        "",
        "set -euo pipefail",
        f"RUN_DIR={shlex.quote(str(paths.run_dir))}",
        f"cd {shlex.quote(str(paths.project_dir))}",
        _EVENT,
        'trap \'event "prepare end exit $?"\' EXIT',
        'event "prepare start on $SLURM_JOB_NODELIST"',
        _hf_home(cfg, paths),
        "export PYTHONUNBUFFERED=1",
        "",
        f"{prefix}{_words(srun)} \\\n  {_words(argv)}",
        "",
    ]
    return "\n".join(lines)
