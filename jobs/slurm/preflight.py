"""The batch script's preflight (trainer/preflight.py): where its all-reduce runs, the lines of
the environment it needs, and its steps."""

from __future__ import annotations

import shlex
from typing import Optional

from common.layouts import checkpoint_bytes
from common.rundir import PREFLIGHT_ENV, RunDir
from jobs.config import Config
from jobs.slurm.client import srun_argv
from jobs.slurm.ranks import Expand, launch_line, words


def where(cfg: Config) -> Optional[str]:
    """Where the preflight's all-reduce runs: "training" (the trainer's first collective, saving a torch
    start and a rendezvous per rank), "step" (a train.script's step of its own), None (off, or
    launch.command, whose image may not hold slipway's trainer)."""
    if not cfg.slurm.preflight or cfg.launch.command:
        return None
    return "step" if cfg.train.script else "training"


def _megabytes(cfg: Config) -> int:
    return 64 if cfg.slurm.gpus_per_node else 4


def environment(cfg: Config) -> list[str]:
    """The script's lines the preflight needs: its own step's port, or the first collective's size."""
    if where(cfg) == "step":
        return [
            "# The preflight's all-reduce forms a group of its own, on the next free port.",
            "PREFLIGHT_PORT=$(( MASTER_PORT + 1 ))",
            'while (exec 3<>"/dev/tcp/$MASTER_ADDR/$PREFLIGHT_PORT") 2>/dev/null; do '
            "PREFLIGHT_PORT=$(( PREFLIGHT_PORT + 1 )); done",
        ]
    if where(cfg) == "training":
        return [
            "# The preflight's all-reduce (MiB, seconds): the training step's first collective",
            "# (trainer/preflight.py AllReduceGate); after_preflight reads a failure.",
            f"export {PREFLIGHT_ENV}={shlex.quote(f'{_megabytes(cfg)} {cfg.slurm.preflight_timeout}')}",
        ]
    return []


def node_command(cfg: Config, paths: RunDir) -> list[str]:
    """Each node's checks (a task per node)."""
    return [cfg.launch.python, "-m", "trainer.preflight", "node", "--run-dir", str(paths.path),
            "--checkpoint-dir", str(paths.path / cfg.checkpoint.dir),
            "--checkpoint-bytes", str(checkpoint_bytes(cfg.model.num_params())), "--gpus", str(cfg.slurm.gpus_per_node),
            *(["--numa-binding"] if cfg.binds_numa else [])]


def steps(cfg: Config, paths: RunDir, container: list[str], prefix: str, warm: bool = False) -> list[str]:
    """The preflight's steps: each node's checks, then the all-reduce where `where` says."""
    s = cfg.slurm
    part = where(cfg)
    if part is None:
        return []
    limit = ["timeout", "-k", "15", str(s.preflight_timeout)]
    # --kill-on-bad-exit=0: a node that fails fast must not cut the other nodes' reports short
    # (where the cluster sets KillOnBadExit=1), or they would be blamed for sending none.
    node_srun = [*limit, *srun_argv(nodes=s.nodes, cpus_per_task=s.cpus_per_task, kill_on_bad_exit=False,
                                    container=container)]
    node_cmd = [*([Expand("${WARM_CLIENT[@]}")] if warm else []), *node_command(cfg, paths)]  # warm too
    allreduce = [cfg.launch.python, "-m", "trainer.preflight", "allreduce", "--megabytes",
                 str(_megabytes(cfg)), "--timeout", str(s.preflight_timeout)]
    lines = [
        "",
        "# Preflight (trainer/preflight.py), each part at most slurm.preflight_timeout: every node checks",
        "# the run directory, free space and its GPUs, reporting on its own; a node that fails or sends",
        "# no report is named and the job retried without it. Then every rank joins a short all-reduce",
        "# (" + ("in a step of its own: the ranks run a train.script" if part == "step" else
                 "the training step's first collective") + ").",
        'PREFLIGHT_LOG="$LOGS/preflight-$JOB_TAG.out"',
        # Warm: each node's checks came with its verification, from its warm process (verify_lib.sh).
        f'pf_t=$SECONDS; set +e; {"checked_warm || " if warm else ""}{prefix}{words(node_srun)} \\\n'
        f'  {words(node_cmd)} > "$PREFLIGHT_LOG" 2>&1',
        'pf_rc=$?; set -e; cat "$PREFLIGHT_LOG"',
        'preflight_nodes "$PREFLIGHT_LOG" "$pf_rc" $((SECONDS - pf_t))',
    ]
    if part != "step":
        return lines
    return lines + [
        'PREFLIGHT_LOG="$LOGS/preflight-$JOB_TAG-allreduce.out"',
        "pf_t=$SECONDS; set +e; " + launch_line(cfg, paths, container, prefix, cmd=allreduce, port="PREFLIGHT_PORT",
                                                 wrap=limit) + ' > "$PREFLIGHT_LOG" 2>&1',
        'pf_rc=$?; set -e; cat "$PREFLIGHT_LOG"',
        'preflight_allreduce "$PREFLIGHT_LOG" "$pf_rc" $((SECONDS - pf_t))',
    ]
