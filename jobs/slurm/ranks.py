"""How the ranks of a run start (the trainer, a train.script or launch.command; by torchrun, one agent
per node, or srun, one task per rank), on the cluster and on this machine (`slipway local`). Every
value a line carries is quoted here: `shlex.quote`, or `shell_value` where it may name a `${VAR}`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from common.errors import ConfigError, pasteable
from common.rundir import CodeSnapshot, RunDir
from edf import Environment, srun_flags
from jobs.config import Config
from jobs.config.sections import NODE_PRESETS
from jobs.slurm.client import srun_argv

# `${VAR}` or `${VAR:-default}` with a default that is literal inside double quotes.
_VAR = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(:-[A-Za-z0-9_./:@%+=, -]*)?\}")


def shell_value(text: str) -> str:
    """Quote `text` for bash, keeping `${VAR}` and `${VAR:-default}` (a default only of characters
    literal in double quotes) as expansions; `$(...)`, backticks and everything else stay literal."""
    if "\n" in text or "\0" in text:
        raise ConfigError("", f"value {text!r} contains a newline or NUL, which cannot be passed safely")
    parts, pos = [], 0
    for m in _VAR.finditer(text):
        if m.start() > pos:
            parts.append(pasteable(text[pos:m.start()]))
        parts.append(f'"{m.group(0)}"')
        pos = m.end()
    if pos < len(text) or not parts:
        parts.append(pasteable(text[pos:]))  # a control character as $'\x1b': the script shows none raw
    return "".join(parts)


def task_command(cfg: Config, paths: RunDir, code: Optional[CodeSnapshot] = None) -> list[str]:
    """What each rank runs: the trainer, a train.script (the code snapshot's copy), or `launch.command`."""
    if cfg.launch.command:
        return list(cfg.launch.command)
    if cfg.train.script:
        script = Path(code.script) if code and code.script else Path(cfg.train.script)
        if not script.is_absolute():
            script = paths.project / script
        return [cfg.launch.python, str(script), "--config", str(paths.config)]
    return [cfg.launch.python, "-m", "trainer", "--config", str(paths.config)]


def torchrun_argv(cfg: Config, *, nnodes: str, rdzv: list[str]) -> list[str]:
    """`python -m torch.distributed.run` (an absolute interpreter: the image's PATH may not reach srun,
    see pyxis); with a node preset each worker is bound to its GPU's NUMA node (its Grace on a GH200)."""
    binding = ["--numa-binding=node"] if cfg.binds_numa else []
    return [cfg.launch.python, "-m", "torch.distributed.run", Expand(f"--nnodes={nnodes}") if "$" in nnodes else f"--nnodes={nnodes}",
            f"--nproc-per-node={cfg.launch.procs_per_node}", *rdzv, *binding, "--max-restarts=0"]


def local_argv(cfg: Config, paths: RunDir, code: Optional[CodeSnapshot] = None) -> list[str]:
    """The same launch as on the cluster, on this machine: `torchrun --standalone`."""
    cmd = task_command(cfg, paths, code)
    if cfg.launch.procs_per_node == 1 and cfg.slurm.nodes == 1:
        return cmd
    if cmd[0] != cfg.launch.python:
        raise ConfigError("launch.command", "a custom command cannot be spread over processes by torchrun; "
                                            "start it with launch.python or set launch.procs_per_node: 1")
    return torchrun_argv(cfg, nnodes="1", rdzv=["--standalone"]) + cmd[1:]


class Expand(str):
    """A word of our own making that bash must expand (`$MASTER_ADDR`...): double-quoted."""


class Value(str):
    """A config value in which `${VAR}` expands and nothing else: `shell_value`."""


def words(argv: list[str]) -> str:
    return " ".join(f'"{a}"' if isinstance(a, Expand) else shell_value(a) if isinstance(a, Value)
                    else pasteable(a) for a in argv)


def container_args(env: Environment, paths: RunDir) -> tuple[list[str], str]:
    """(srun arguments, the `NAME=value ` words before the srun): pyxis's --container-env passes the
    [env] values from srun's environment, set for the srun alone so the script keeps its own (PATH...)."""
    flags = srun_flags(env, paths.env_toml)
    return [Value(a) for a in flags.args], "".join(f"{name}={shell_value(value)} " for name, value in flags.exports)


def launch_line(cfg: Config, paths: RunDir, container: list[str], prefix: str,
            cmd: list[str] | None = None, port: str = "MASTER_PORT", wrap: list[str] = (),
            code: Optional[CodeSnapshot] = None, warm: bool = False) -> str:
    """The `srun` line that starts every rank: the trainer, or `cmd` (the preflight's all-reduce, its
    rendezvous on `$port`, bounded by the words `wrap`, its ranks ending together: no --wait). The
    training step's tasks report their exits into $SLIPWAY_EXITS. `warm`: ranks start via $WARM_CLIENT."""
    report = cmd is None
    cmd = task_command(cfg, paths, code) if cmd is None else cmd
    torchrun = cfg.launcher == "torchrun"
    # A node preset's srun launcher runs one task per GPU, on the cores and memory next to it:
    # task i gets GPU i and cores [i * cpus_per_task, (i + 1) * cpus_per_task), on a GH200 its own Grace.
    srun = [*wrap, *srun_argv(nodes=cfg.slurm.nodes, ntasks_per_node=1 if torchrun else cfg.launch.procs_per_node,
                              cpus_per_task=cfg.slurm.cpus_per_task, kill_on_bad_exit=True, wait=None if wrap else 60,
                              near_gpu=not torchrun and cfg.launch.preset in NODE_PRESETS, container=container)]
    if torchrun:
        if cmd[0] != cfg.launch.python:
            raise ConfigError("launch.command", "with launcher torchrun the command must start with launch.python "
                                                f"({cfg.launch.python}); use launcher srun for other programs")
        rdzv = [Expand(f"--rdzv-endpoint=$MASTER_ADDR:${port}"), Expand("--rdzv-id=$SLURM_JOB_ID"),
                "--rdzv-backend=c10d"]
        argv = torchrun_argv(cfg, nnodes=Expand("$SLURM_NNODES"), rdzv=rdzv)
        if report:  # each worker in the wrapper too: the agent's own exit is 1 whatever ended its worker
            argv = ["bash", "-c", REPORT_EXIT, "slipway-task", *argv, "--no-python", "bash", "-c", REPORT_EXIT,
                    "slipway-rank", *cmd]
        else:
            argv += cmd[1:]
    else:  # one task per process: the rank variables come from Slurm's own
        mapper = ('export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS '
                  'LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE NODE_RANK=$SLURM_NODEID; ')
        client = [Expand("${WARM_CLIENT[@]}")] if warm else []
        argv = ["bash", "-c", mapper + (REPORT_EXIT if report else 'exec "$@"'), "slipway-rank", *client, *cmd]
        if port != "MASTER_PORT":  # init_process_group reads MASTER_PORT: this launch's own, for its srun alone
            prefix += f'MASTER_PORT="${port}" '
    return f"{prefix}{words(srun)} \\\n  {words(argv)}"


# Each task of the training step reports its exit and node (job_lib.sh step_exit): rank-RANK ($0
# `slipway-rank`: srun's task or torchrun's worker), task-PROCID around a torchrun agent; a failed
# one during which its node's OOM killer ran (/proc/vmstat's oom_kill moved) names the node (after_oom).
REPORT_EXIT = ('o=$(grep -s "^oom_kill " /proc/vmstat); n=${SLURMD_NODENAME:-$(hostname)}; "$@"; rc=$?; '
               'if [ "$0" = slipway-rank ]; then f=rank-$RANK; else f=task-$SLURM_PROCID; fi; '
               'echo "$rc $n" > "$SLIPWAY_EXITS/$f" 2>/dev/null; [ "$rc" = 0 ] || '
               '[ "$(grep -s "^oom_kill " /proc/vmstat)" = "$o" ] || echo "$n" > "$SLIPWAY_EXITS/oom-$f" 2>/dev/null; '
               'exit "$rc"')
