"""The batch script: one pure render function for every runtime and launcher.

Every config value that reaches the script goes through `shlex.quote` (or
`shell_value`, which keeps `${VAR}` references and quotes everything else), so
no run name, path or env value can ever run a command.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from edf import Environment, srun_flags
from edf.environment import secret_error, secret_word
from jobs.config import NODE_PRESETS, Config
from trainer.config import HANG_EXIT, HANGS_DIR, PREFLIGHT_EXIT, REQUEUE_EXIT, STOP_FILE, ConfigError
from trainer.preflight import checkpoint_bytes

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
        "# Secrets stay in the environment they came from (container.env_from_host): never written",
        "# here, never expanded into a command that set -x would print (hence :+set, not the value).",
        'if [ -n "${WANDB_API_KEY:+set}" ]; then export WANDB_MODE="${WANDB_MODE:-online}"; '
        "else export WANDB_MODE=offline; fi",
        f"export NCCL_DEBUG={'INFO' if debug else '${NCCL_DEBUG:-WARN}'}",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "export PYTHONFAULTHANDLER=1",
        "export PYTHONUNBUFFERED=1",
        f"export OMP_NUM_THREADS={_omp_threads(cfg)}",
        f"export SLIPWAY_RUN_DIR={shlex.quote(str(paths.run_dir))}",
        'export SLIPWAY_JOB_TAG="$JOB_TAG"',
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
    if cfg.slurm.preflight and not cfg.launch.command:
        lines += [
            "# The preflight's all-reduce forms a group of its own, on the next free port.",
            "PREFLIGHT_PORT=$(( MASTER_PORT + 1 ))",
            'while (exec 3<>"/dev/tcp/$MASTER_ADDR/$PREFLIGHT_PORT") 2>/dev/null; do '
            "PREFLIGHT_PORT=$(( PREFLIGHT_PORT + 1 )); done",
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
        for item, name in zip(value.split(","), listed):
            if "=" in item and secret_word(name):
                raise secret_error(where, name)
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


def _container_args(env: Environment, paths: RunPaths) -> tuple[list[str], list[str]]:
    """(srun arguments, NAME=value words set for the srun line only) for the run's environment.

    pyxis's --container-env passes the [env] values from srun's environment: they are set
    for the srun alone so the host commands of the script keep their own (PATH...)."""
    flags = srun_flags(env, paths.env_toml)
    return [_Value(a) for a in flags.args], [f"{name}={shell_value(value)}" for name, value in flags.exports]


def _launch(cfg: Config, paths: RunPaths, container: list[str], assigns: list[str],
            cmd: list[str] | None = None, port: str = "MASTER_PORT", wrap: list[str] = ()) -> str:
    """The `srun` line that starts every rank: the trainer, or `cmd` (the preflight's all-reduce)
    launched the same way with its rendezvous on `$port`, as a step bounded by the words `wrap`
    (`timeout ...`), whose ranks end together (no --wait); not backgrounded."""
    cmd = task_command(cfg, paths) if cmd is None else cmd
    prefix = "".join(f"{a} " for a in assigns)
    if wrap:
        srun = [*wrap, "srun", f"--nodes={cfg.slurm.nodes}", f"--cpus-per-task={cfg.slurm.cpus_per_task}",
                "--kill-on-bad-exit=1"]
    else:
        srun = ["srun", "--kill-on-bad-exit=1", "--wait=60", f"--cpus-per-task={cfg.slurm.cpus_per_task}",
                f"--nodes={cfg.slurm.nodes}"]
    if cfg.launch.launcher == "torchrun":
        if cmd[0] != cfg.launch.python:
            raise ConfigError("launch.command", "with launcher torchrun the command must start with launch.python "
                                                f"({cfg.launch.python}); use launcher srun for other programs")
        rdzv = [_Expand(f"--rdzv-endpoint=$MASTER_ADDR:${port}"), _Expand("--rdzv-id=$SLURM_JOB_ID"),
                "--rdzv-backend=c10d"]
        argv = torchrun_argv(cfg, nnodes=_Expand("$SLURM_NNODES"), rdzv=rdzv) + cmd[1:]
        return f"{prefix}{_words(srun + ['--ntasks-per-node=1'] + container)} \\\n  {_words(argv)}"
    # One task per process: the rank variables come from Slurm's own.
    mapper = ('export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS '
              'LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE NODE_RANK=$SLURM_NODEID; exec "$@"')
    srun += [f"--ntasks-per-node={cfg.launch.procs_per_node}"]
    if cfg.launch.preset in NODE_PRESETS:
        # One task per GPU, on the cores and memory next to it: task i gets GPU i and cores
        # [i * cpus_per_task, (i + 1) * cpus_per_task), which on a GH200 is its own Grace.
        srun += ["--gpus-per-task=1", "--cpu-bind=verbose,cores", "--mem-bind=local"]
    srun += container
    if port != "MASTER_PORT":  # init_process_group reads MASTER_PORT: this launch's own, for its srun alone
        prefix += f'MASTER_PORT="${port}" '
    return f"{prefix}{_words(srun)} \\\n  {_words(['bash', '-c', mapper, 'slipway-task', *cmd])}"


_COUNT_EVENTS = ('count_events() { local n; n=$(grep -F " job $SLURM_JOB_ID $* " "$RUN_DIR/events.log" 2>/dev/null '
                 '| wc -l) || true; echo "${n:-0}"; }')


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
        f"srun --overlap --nodes={cfg.slurm.nodes} --ntasks-per-node=1 --cpus-per-task=1 "
        f'bash -c {shlex.quote("; ".join(script))} slipway-node "$RUN_DIR" > /dev/null 2>&1 &',
        'HELPER_PIDS+=("$!")',
    ]


# This attempt's named pyxis container (JOB_TAG: the job id, rN after the Nth requeue).
PYXIS_CONTAINER = "slipway-${JOB_TAG}"


def _remove_pyxis_container(cfg: Config) -> list[str]:
    """pyxis keeps a named container on every node after the job (its default
    container_scope=global keeps it as pyxis_NAME; with container_scope=job it is
    pyxis_JOBID_NAME and the epilog removes it): remove ours, best effort, from each node."""
    script = 'for n in "pyxis_$1" "pyxis_${SLURM_JOB_ID}_$1"; do enroot remove --force "$n"; done; true'
    return [
        "  # The job's named pyxis container, unpacked on every node: removed, not left behind.",
        f"  timeout 120 srun --overlap --nodes={cfg.slurm.nodes} --ntasks-per-node=1 --cpus-per-task=1 "
        f'bash -c {shlex.quote(script)} slipway-rm "{PYXIS_CONTAINER}" > /dev/null 2>&1 || true',
    ]


def _retry_function(cfg: Config) -> list[str]:
    """`retry_or_stop KIND CODE [NODE...]`: the failure retries (slurm.max_retries) of one job, each
    decision in events.log. A retry requeues the job without the nodes to blame, if its partition
    has enough other usable nodes; `scontrol update` changes ExcNodeList only of a pending job, so
    the job is requeued held, updated, then released."""
    s = cfg.slurm
    head = ["# retry_or_stop KIND CODE [NODE...]: requeue this job (slurm.max_retries) without the nodes to",
            "# blame, where the partition has enough others; else end with CODE. Each decision in events.log.",
            "retry_or_stop() {", "  local kind=$1 code=$2; shift 2", '  local bad="$*" excluded="" usable=0 node state']
    if not s.requeue:
        return head + ['  event "not retrying ($kind): slurm.requeue is off"', '  exit "$code"', "}"]
    return head + [
        f'  if [ "$RETRIES" -ge {s.max_retries} ]; then',
        f'    event "not retrying ($kind): slurm.max_retries ({s.max_retries}) reached"',
        '    exit "$code"',
        "  fi",
        "  if [ -n \"$bad\" ]; then",
        "    excluded=$(scontrol show job -o \"$SLURM_JOB_ID\" | grep -o 'ExcNodeList=[^ ]*' | sed 's/^ExcNodeList=//') "
        '|| excluded=""',
        '    [ "$excluded" != "(null)" ] || excluded=""',
        "    excluded=$( { [ -z \"$excluded\" ] || scontrol show hostnames \"$excluded\"; printf '%s\\n' $bad; } "
        "| sort -u | paste -sd, - )",
        "    while read -r node state; do",
        '      case ",$excluded," in *",$node,"*) continue ;; esac',
        "      case \"${state%[~#%]}\" in idle|mix|alloc|comp|plnd) usable=$((usable + 1)) ;; esac",
        "    done < <(sinfo -h -N ${SLURM_JOB_PARTITION:+-p \"$SLURM_JOB_PARTITION\"} -o '%N %t' 2>/dev/null)",
        f'    if [ "$usable" -lt {s.nodes} ]; then',
        f'      event "not retrying ($kind): without ${{bad% }} partition ${{SLURM_JOB_PARTITION:-(default)}} has $usable usable '
        f'node(s), the job needs {s.nodes}"',
        '      exit "$code"',
        "    fi",
        f'    event "retry $((RETRIES + 1))/{s.max_retries} ($kind): requeueing without ${{bad% }} (excluded nodes: '
        '$excluded)"',
        "    trap '' TERM  # the requeue ends this job's processes: the three calls must finish first",
        '    scontrol requeuehold "$SLURM_JOB_ID" || { event "requeue failed"; exit "$code"; }',
        '    scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$excluded" || event "could not exclude $excluded"',
        '    scontrol release "$SLURM_JOB_ID"',
        "  else",
        f'    event "retry $((RETRIES + 1))/{s.max_retries} ($kind): requeueing (no node to blame)"',
        '    scontrol requeue "$SLURM_JOB_ID" || { event "requeue failed"; exit "$code"; }',
        "  fi",
        "  exit 0",
        "}",
    ]


def _preflight(cfg: Config, paths: RunPaths, container: list[str], assigns: list[str]) -> list[str]:
    """The preflight (trainer/preflight.py): each node's checks, then an all-reduce across every rank."""
    s = cfg.slurm
    if not s.preflight or cfg.launch.command:
        return []
    limit = ["timeout", "-k", "15", str(s.preflight_timeout)]
    prefix = "".join(f"{a} " for a in assigns)
    checkpoint_dir = paths.run_dir / cfg.checkpoint.dir
    # --kill-on-bad-exit=0: a node that fails fast must not cut the other nodes' reports short
    # (where the cluster sets KillOnBadExit=1), or they would be blamed for sending none.
    node_srun = [*limit, "srun", f"--nodes={s.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={s.cpus_per_task}",
                 "--kill-on-bad-exit=0", *container]
    node_cmd = [cfg.launch.python, "-m", "trainer.preflight", "node", "--run-dir", str(paths.run_dir),
                "--checkpoint-dir", str(checkpoint_dir),
                "--checkpoint-bytes", str(checkpoint_bytes(cfg.model.num_params())), "--gpus", str(s.gpus_per_node)]
    allreduce = [cfg.launch.python, "-m", "trainer.preflight", "allreduce", "--megabytes",
                 "64" if s.gpus_per_node else "4", "--timeout", str(s.preflight_timeout)]
    t = s.preflight_timeout
    return [
        "",
        "# Preflight (trainer/preflight.py), each step at most slurm.preflight_timeout: every node checks",
        "# the run directory, free space and its GPUs, reporting on its own; a node that fails or sends",
        "# no report is named and the job retried without it. Then every rank joins a short all-reduce.",
        'PREFLIGHT_LOG="$RUN_DIR/logs/preflight-$JOB_TAG.out"',
        "set +e",
        f'{prefix}{_words(node_srun)} \\\n  {_words(node_cmd)} > "$PREFLIGHT_LOG" 2>&1',
        "pf_rc=$?",
        "set -e",
        'cat "$PREFLIGHT_LOG"',
        'PF_BAD=""',
        "for node in $NODES; do",
        '  line=$(grep -F -m1 "slipway-preflight $node " "$PREFLIGHT_LOG") || line=""',
        '  case "$line" in',
        '    "slipway-preflight $node ok"*) ;;',
        f'    "") PF_BAD+="$node "; event "preflight failed on $node: no report within {t} s (its container did not '
        'start there, or the node is unreachable; step exit $pf_rc)" ;;',
        '    *) PF_BAD+="$node "; event "preflight failed on $node: ${line#*fail: }" ;;',
        "  esac",
        "done",
        *(['# Every node failed alike (a full filesystem, a bad config): no node to blame.',
           f'[ -z "$PF_BAD" ] || [ "${{PF_BAD% }}" != "$NODES" ] || retry_or_stop preflight {PREFLIGHT_EXIT}']
          if s.nodes > 1 else []),
        f'[ -z "$PF_BAD" ] || retry_or_stop preflight {PREFLIGHT_EXIT} $PF_BAD',
        'PREFLIGHT_LOG="$RUN_DIR/logs/preflight-$JOB_TAG-allreduce.out"',
        "set +e",
        _launch(cfg, paths, container, assigns, cmd=allreduce, port="PREFLIGHT_PORT", wrap=limit)
        + ' > "$PREFLIGHT_LOG" 2>&1',
        "pf_rc=$?",
        "set -e",
        'cat "$PREFLIGHT_LOG"',
        'line=$(grep -F -m1 "slipway-preflight-allreduce " "$PREFLIGHT_LOG") || line=""',
        'case "$line" in',
        '  "slipway-preflight-allreduce ok: "*) event "preflight ok on $SLURM_JOB_NODELIST: ${line#*ok: }" ;;',
        f'  "") event "preflight failed: the all-reduce across every rank gave no result within {t} s (step exit '
        f'$pf_rc)"; retry_or_stop preflight {PREFLIGHT_EXIT} ;;',
        f'  *) event "preflight failed: ${{line#*fail: }}"; retry_or_stop preflight {PREFLIGHT_EXIT} ;;',
        "esac",
    ]


def _latest_checkpoint(cfg: Config) -> str:
    """A shell function printing the step of the latest complete checkpoint (0: none), the
    trainer's layout (step-NNNNNN/ with a COMPLETE marker), as jobs.local reads it."""
    ckpt = Path(cfg.checkpoint.dir)
    where = shlex.quote(str(ckpt)) if ckpt.is_absolute() else f'"$RUN_DIR"/{shlex.quote(str(ckpt))}'
    return ("latest_checkpoint() { local f s n=0; for f in " + where + "/step-*/COMPLETE; do "
            "s=${f%/COMPLETE}; s=${s##*/step-}; [[ $s =~ ^[0-9]+$ ]] && [ $((10#$s)) -gt $n ] && n=$((10#$s)); "
            "done; echo $n; }")


def _after_step(cfg: Config) -> list[str]:
    """What the script decides once the training step has ended, from the files the ranks wrote:
    a hang (dumps in hangs/), a stop request (time-limit requeue), a node that died."""
    s = cfg.slurm
    lines = [
        "# A hang: the ranks' watchdogs wrote their stacks to hangs/ (trainer/watchdog.py). The nodes",
        "# some of whose ranks wrote none in time (frozen, dead; a frozen rank may dump `late` once",
        "# Slurm's teardown resumes it) are the ones to blame.",
        'shopt -s nullglob; HANG_DUMPS=("$RUN_DIR/hangs/$JOB_TAG-"*.txt); shopt -u nullglob',
        'if [ "${#HANG_DUMPS[@]}" -gt 0 ]; then',
        '  SILENT=""',
        "  for node in $NODES; do",
        "    dumped=0",
        '    for f in "$RUN_DIR/hangs/$JOB_TAG-$node-"*.txt; do',
        '      r=${f##*/"$JOB_TAG-$node-"}; [[ ${r%.txt} =~ ^[0-9]+$ ]] || continue',
        '      first=""; read -r first < "$f" || true',
        '      [[ $first == *" on-time" ]] && dumped=$((dumped + 1))',
        "    done",
        f'    [ "$dumped" -ge {cfg.launch.procs_per_node} ] || SILENT+="$node "',
        "  done",
        '  read -r _ _ _ _ _ _ _ hung_step _ _ _ _ hang_limit _ < "${HANG_DUMPS[0]}" || true',
        f'  event "hang: no step completed for $hang_limit s after step $hung_step; stack dumps from '
        f'${{#HANG_DUMPS[@]}} of {cfg.world_size} ranks in hangs/$JOB_TAG-*.txt${{SILENT:+; not answering in '
        'time: the ranks on ${SILENT% }}"',
        f"  retry_or_stop hang {HANG_EXIT} $SILENT",
        "fi",
        f'if [ "$STOP_REQUESTED" = 1 ] || [ "$rc" = {REQUEUE_EXIT} ]; then',
        "  # torchrun exits 1 when any rank exits non-zero, the trainer's 75 (saved, requeue me)",
        "  # included: a checkpoint newer than the one at the warning says the trainer saved.",
        '  SAVED=$(latest_checkpoint)',
        f'  if [ "$rc" = {REQUEUE_EXIT} ] || [ "$SAVED" -gt "${{STOP_CHECKPOINT:-0}}" ]; then',
        '    OUTCOME="saved after the stop request"',
        '    [ "$SAVED" = 0 ] || OUTCOME+=" (checkpoint at step $SAVED)"',
        "  else",
        '    OUTCOME="no checkpoint saved after the stop request (step exit $rc)"',
        "  fi",
    ]
    if s.requeue:
        limit = s.max_requeues
        lines += [
            f'  if [ "$REQUEUES" -ge {limit} ]; then',
            f'    event "not requeueing after the time-limit warning: slurm.max_requeues ({limit}) reached; $OUTCOME"',
            f"    exit {REQUEUE_EXIT}",
            "  fi",
            f'  event "time-limit requeue $((REQUEUES + 1))/{limit}: $OUTCOME, requeueing"',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "  exit 0",
        ]
    else:
        lines += ['  event "time-limit stop: $OUTCOME; slurm.requeue is off"', f"  exit {REQUEUE_EXIT}"]
    lines += [
        "fi",
        "# A node that died under the step (not responding, down or drained) is retried without;",
        "# one sinfo for all of them (a node in several partitions is listed once for each).",
        'if [ "$rc" != 0 ]; then',
        '  DEAD=""',
        "  while read -r node state; do",
        "    case \"$state\" in down*|drain*|drng*|fail*|*'*') ;; *) continue ;; esac",
        '    case " $DEAD" in *" $node "*) ;; *) DEAD+="$node " ;; esac',
        "  done < <(sinfo -h -N -n \"$SLURM_JOB_NODELIST\" -o '%N %t' 2>/dev/null)",
        '  if [ -n "$DEAD" ]; then',
        '    event "node failure: ${DEAD% } not responding, down or drained after the step failed (exit $rc)"',
        '    retry_or_stop "node failure" "$rc" $DEAD',
        "  fi",
        "fi",
        'exit "$rc"',
        "",
    ]
    return lines


def render_sbatch(cfg: Config, paths: RunPaths, env: Environment) -> str:
    """The whole batch script for `cfg`, reading and writing only inside `paths.run_dir`;
    `env` is the run's container environment (`jobs.container.run_environment`)."""
    q = shlex.quote
    s = cfg.slurm
    run_dir = q(str(paths.run_dir))
    container, assigns = _container_args(env, paths)
    # Under pyxis every srun step unpacks the image into a container of its own, unless the
    # steps name one: the preflight's steps then create it and training starts in it at once.
    shared = env.runtime == "pyxis" and cfg.slurm.preflight and not cfg.launch.command
    if shared:
        container.append(_Value("--container-name=" + PYXIS_CONTAINER))
    lines = _header(cfg, paths) + ["", "set -euo pipefail"]
    if cfg.launch.debug:
        lines.append("set -x")
    lines += [
        f"RUN_DIR={run_dir}",
        f"cd {q(str(paths.project_dir))}",
        'mkdir -p "$RUN_DIR/logs" "$RUN_DIR/gutil" "$RUN_DIR/heartbeats" "$RUN_DIR/' + HANGS_DIR + '"',
        'rm -f "$RUN_DIR/' + STOP_FILE + '"',
        _EVENT,
        "# What this job (its id survives requeues) has used: failure retries, time-limit requeues.",
        _COUNT_EVENTS,
        "RETRIES=$(count_events retry) REQUEUES=$(count_events time-limit requeue)",
        "# Names this attempt's files (hang dumps, preflight logs): the job id, rN after the Nth requeue.",
        'JOB_TAG=$SLURM_JOB_ID; [ "${SLURM_RESTART_COUNT:-0}" = 0 ] || JOB_TAG="${SLURM_JOB_ID}r$SLURM_RESTART_COUNT"',
        'NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd " " -)',
        f'event "start on $SLURM_JOB_NODELIST (restart ${{SLURM_RESTART_COUNT:-0}}), failure retries '
        f'$RETRIES/{s.max_retries}, time-limit requeues $REQUEUES/{s.max_requeues}"',
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
        *(_remove_pyxis_container(cfg) if shared else []),
        '  event "end exit $rc"',
        "}",
        "trap cleanup EXIT",
        _latest_checkpoint(cfg),
        "# Slurm's warning before the time limit: ask the trainer to save at the step boundary.",
        "on_warning() {",
        "  STOP_REQUESTED=1 TRAPPED=1",
        "  STOP_CHECKPOINT=$(latest_checkpoint)",
        '  event "time limit warning: stop requested"',
        '  touch "$RUN_DIR/' + STOP_FILE + '"',
        "}",
        "trap on_warning USR1",
        *_retry_function(cfg),
        f'( while sleep {HEARTBEAT_SECONDS}; do date --iso-8601=seconds > "$RUN_DIR/heartbeat"; done ) &',
        'HELPER_PIDS+=("$!")',
        'date --iso-8601=seconds > "$RUN_DIR/heartbeat"',
        *_node_helper(cfg),
    ]
    if cfg.launch.pre_launch:
        lines += ["", "# Pre-launch commands from launch.pre_launch (run as written, on the first node)."]
        lines += list(cfg.launch.pre_launch)
    lines += _preflight(cfg, paths, container, assigns)
    lines += [
        "",
        "# The training step, in the background so the warning trap runs at once.",
        _launch(cfg, paths, container, assigns) + " &",
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
        *_after_step(cfg),
    ]
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
