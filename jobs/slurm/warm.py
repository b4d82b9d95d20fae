"""Warm ranks in an allocation (`slipway run`, launch.warm): the batch script's part, and
`slipway run --stop-warm`; the warm process itself is trainer/warm.py.

Per node and allocation, one warm process per key: a step named `slipway-warm-KEY` (Slurm ends it
with the allocation), its socket in a folder of the user's in the node's /dev/shm, which containers
share. KEY hashes what it was started with: the image, the container settings (the runs root mounted
in place of one run's directory, so every later run and snapshot is seen), the interpreter, the
environment and the warm process's own code; any changed, a new warm process.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common.errors import ConfigError
from common.rundir import CodeSnapshot, RunDir
from edf import Environment, srun_flags
from jobs import trainer_door
from jobs.config import Config, interpreter
from jobs.slurm import preflight
from jobs.slurm.client import job_steps, signal_steps, srun_argv
from jobs.slurm.ranks import Expand, Value, container_args, words
from jobs.config.sections import NODE_PRESETS

STEP = "slipway-warm-"  # the warm steps' names: STEP + KEY


@dataclass(frozen=True)
class WarmPlan:
    key: str  # 16 hex digits
    env: Environment  # the warm step's container environment


def why_cold(cfg: Config, code: Optional[CodeSnapshot]) -> str:
    """Why `slipway run` of `cfg` starts every rank cold, "" where it keeps warm processes."""
    if not cfg.launch.warm:
        return "launch.warm is off"
    if code is None:
        return "code.snapshot is off (a warm process imports the run's code from its snapshot)"
    if cfg.launcher != "srun":
        return f"the ranks start by torchrun ({cfg.launch_choice[1]})"
    if cfg.launch.command and (len(cfg.launch.command) < 2 or cfg.launch.command[0] != cfg.launch.python):
        return "launch.command is no `launch.python SCRIPT|-m MODULE` program"
    if cfg.container.runtime == "edf":
        return "runtime edf: the Container Engine's warm processes are not supported yet"
    return ""


def plan(cfg: Config, paths: RunDir, env_of, code: Optional[CodeSnapshot], image: str = "") -> Optional[WarmPlan]:
    """The warm processes `slipway run` keeps for `cfg` (None: every rank cold, `why_cold`). `env_of`:
    jobs/runs/container.py run_environment, called with the runs root, under which every run and code
    snapshot lies; `image`: its build hash or its bytes' identity."""
    if why_cold(cfg, code):
        return None
    try:
        env = env_of(RunDir(paths.path.parent, paths.project))
        flags = srun_flags(env).expanded() if env.in_container else ([], {})
    except ConfigError:  # a mount of the user's would hide the runs root: the run's own check says so
        return None
    preset = NODE_PRESETS.get(cfg.launch.preset)
    warm_code = [Path(code.source) / name for name in trainer_door.warm_code()] if code and code.source else []
    what = {
        "image": image or env.image, "container": flags, "python": cfg.launch.python,
        "env": sorted(cfg.launch.env.items()), "preset": sorted(preset.env) if preset else [],
        "debug": cfg.launch.debug, "gpus": cfg.slurm.gpus_per_node, "cpus": _cpus_per_node(cfg),
        "warm code": [hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else "" for f in warm_code],
    }
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return WarmPlan(key, env)


def _cpus_per_node(cfg: Config) -> int:
    return cfg.launch.procs_per_node * (cfg.slurm.cpus_per_task or 1)


def settings(warm: Optional[WarmPlan], cfg: Config, paths: RunDir) -> list[str]:
    """The batch script's warm settings, set under `slipway run` alone: WARM_CHECK, the node check the
    verification asks of the warm process from the host (no srun step enters the container for it).
    Its client needs only the standard library: it runs by the interpreter slipway runs under where
    a node has it (`python3` on a PATH can be a wrapper that costs more than the check: pyenv's shim
    takes 0.15 s a start), else by the host's python3, or launch.python's without a container."""
    if warm is None:
        return []
    python = shlex.quote(cfg.launch.python)
    check = []
    if preflight.where(cfg):
        host = "python3" if warm.env.in_container else cfg.launch.python
        check = [f"  WARM_CHECK=({max(10, cfg.slurm.preflight_timeout // 2)} {shlex.quote(interpreter(sys.executable))} "
                 f"{shlex.quote(host)} -S "
                 f'"$CODE_DIR"/trainer/warm_rank.py node "$WARM_SOCKET" -- {words(preflight.node_command(cfg, paths))})']
    return [
        "# Warm ranks (`slipway run`, launch.warm; jobs/slurm/warm.py): each rank starts from the node's warm",
        "# process of this key (trainer/warm.py), which holds torch imported; none: the rank starts cold.",
        f"export SLIPWAY_WARM_ID={warm.key}",
        "WARM_SOCKET='' WARM_CLIENT=() WARM_CHECK=() WARM_CHECKED='' WARM_COLD='' WARM_OFF=''",
        'if [ -n "${SLIPWAY_IN_ALLOCATION:-}" ]; then',
        f'  WARM_SOCKET="${{SLIPWAY_WARM_DIR:-/dev/shm}}/{STEP}$(id -u)/$SLURM_JOB_ID-$SLIPWAY_WARM_ID"',
        f'  WARM_CLIENT=({python} -S "$CODE_DIR"/trainer/warm_rank.py rank "$WARM_SOCKET" --)',
        *check,
        '  export TMPDIR="${TMPDIR:-/tmp}"  # as every task sees it: Slurm sets it unset for a node\'s first alone',
        "fi",
    ]


def start_function(cfg: Config, paths: RunDir, warm: Optional[WarmPlan], container_name: Optional[str]) -> list[str]:
    """`warm_start NODELIST COUNT`: the warm step, in a session of its own to outlive this script,
    asking for every CPU and GPU of a node's ranks, which share its cgroup (a Slurm that tracks
    processes by cgroup gets none: verify_lib.sh node_check)."""
    if warm is None:
        return []
    container, prefix = container_args(warm.env, paths) if warm.env.in_container else ([], "")
    if container_name:
        container.append(Value(f"--container-name={container_name}"))
    argv = srun_argv(nodes=1, ntasks=1, cpus_per_task=_cpus_per_node(cfg), gpus_per_node=cfg.slurm.gpus_per_node,
                     overlap=True, kill_on_bad_exit=False, container=container,
                     extra=[Expand("--nodelist=$1"), Expand(f"--job-name={STEP}$SLIPWAY_WARM_ID")])
    argv[argv.index("--nodes=1")] = Expand("--nodes=$2")  # one task on each node of NODELIST
    argv[argv.index("--ntasks=1")] = Expand("--ntasks=$2")
    return [
        f"WARM_LOG={shlex.quote(str(paths.warm_logs))}/\"$SLURM_JOB_ID-$SLIPWAY_WARM_ID.out\"",
        "warm_start() {",
        # Nothing of this run's goes with it: no descriptor (the run's lock, which would keep the run
        # locked while the allocation lasts), no variable that names it (a launcher sweeps by them).
        '  ( for fd in /proc/$BASHPID/fd/*; do fd=${fd##*/}; [ "$fd" -le 2 ] || eval "exec $fd>&-" 2>/dev/null; done',
        f"    {prefix}exec env -u SLIPWAY_RUN_DIR -u SLIPWAY_JOB_TAG -u SLIPWAY_CODE -u SLIPWAY_EVENT_JOB setsid {words(argv)} \\",
        f'    {shlex.quote(cfg.launch.python)} "$CODE_DIR"/trainer/warm.py serve "$WARM_SOCKET" --code "$CODE_DIR"',
        '  ) > "$WARM_LOG" 2>&1 < /dev/null &',
        "  WARM_PID=$!",
        "}",
    ]


def stop(job_id: str) -> list[str]:
    """`slipway run --stop-warm`: allocation `job_id`'s warm steps sent SIGTERM (each ends once its
    ranks have); the steps asked."""
    steps = [step for step, name in job_steps(job_id) if name.startswith(STEP)]
    if steps:
        signal_steps(steps, "TERM")
    return steps
