"""The preflight: before training starts, every node of the allocation proves it can train
(what it checks and why: docs/runs.md, "Preflight"), each part bounded by `slurm.preflight_timeout`:

    python -m trainer.preflight node ...   one task per node, no collective, before training
    AllReduceGate                          every rank, first thing in the training step

`node` prints one line the batch script reads, `slipway-preflight NODE ok: ...` or
`slipway-preflight NODE fail: REASON` (its log lines go to stderr), each node on its own, so a bad
node cannot hide the others' answers. The all-reduce runs in the training step's own process group
(asked for through PREFLIGHT_ENV); a rank that fails it writes why to PREFLIGHT_FAILED_FILE among
the step's exit reports and exits PREFLIGHT_EXIT; a `train.script` of the user's own runs `python -m
trainer.preflight allreduce` as a step of its own (`slipway-preflight-allreduce ok: ...`).

Exit status: 0 passed, PREFLIGHT_EXIT (5) failed, 2 bad arguments.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, Optional

from common.edge import Parser
from common.environ import count as env_count
from common.errors import human
from common.events import append_event
from common.rundir import PREFLIGHT_ENV, PREFLIGHT_EXIT, PREFLIGHT_FAILED_FILE
from trainer.topology import check_free_space, gpu_pci_addresses, numa_binding, numactl_show, tool_output
from trainer.watchdog import event_job, node_name

# ---------------------------------------------------------------- node checks


def check_run_dir(run_dir: Path) -> tuple[bool, str]:
    """Write, read back and remove a file in the run directory."""
    probe = run_dir / f".preflight-{node_name()}-{os.getpid()}"
    try:
        if not run_dir.is_dir():
            return False, f"run directory {run_dir} is not reachable from this node's container (no such directory)"
        probe.write_text(node_name())
        seen = probe.read_text()
        probe.unlink()
    except OSError as exc:
        return False, f"run directory {run_dir} is not writable from this node's container ({exc.strerror or exc})"
    if seen != node_name():
        return False, f"run directory {run_dir}: a file written there read back as {seen!r}"
    return True, "run directory writable"


def check_write_speed(checkpoint_dir: Path, needed: int, seconds: float = 3.0) -> tuple[bool, str]:
    """How fast this node writes where checkpoints go: up to 64 MiB (at most one checkpoint's size)
    in 1 MiB blocks, each synced to disk, for at most `seconds`; the batch script sizes its
    time-limit warning by it before the run's first save (`write_bps=N`, job_lib's warning_lead)."""
    probe = checkpoint_dir / f".preflight-write-{node_name()}-{os.getpid()}"
    block, total = b"\0" * (1 << 20), max(1 << 20, min(64 << 20, needed))
    written, start = 0, time.monotonic()
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            while written < total and (written == 0 or time.monotonic() - start < seconds):
                f.write(block)
                f.flush()
                os.fsync(f.fileno())
                written += len(block)
        took = max(time.monotonic() - start, 1e-6)
    except OSError as exc:
        return False, f"{checkpoint_dir} (where checkpoints go) is not writable from this node ({exc.strerror or exc})"
    finally:
        probe.unlink(missing_ok=True)
    return True, f"writes {human(int(written / took))}/s where checkpoints go write_bps={int(written / took)}"


def check_gpus(expected: int) -> tuple[bool, str]:
    """`expected` GPUs visible and healthy: nvidia-smi (where it exists) and torch."""
    problems, seen = [], ""
    if shutil.which("nvidia-smi"):
        out, why = tool_output("nvidia-smi", "--query-gpu=index,name,ecc.errors.uncorrected.volatile.total",
                               "--format=csv,noheader,nounits")
        if out is None:
            return False, why
        rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
        if len(rows) < expected:
            problems.append(f"nvidia-smi sees {len(rows)} GPU(s), the job asked for {expected}")
        for row in rows:
            if len(row) >= 3 and row[2].isdigit() and int(row[2]) > 0:
                problems.append(f"GPU {row[0]} ({row[1]}) has {row[2]} uncorrected ECC errors")
        seen = rows[0][1] if rows and len(rows[0]) > 1 else ""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < expected:
        problems.append(f"torch sees {count} CUDA device(s), the job asked for {expected}")
    for i in range(min(count, expected)):
        try:
            x = torch.ones(256, 256, device=f"cuda:{i}")
            value = (x @ x).sum().item()
            if value != 256.0 ** 3:
                problems.append(f"GPU {i} computed {value} for {256.0 ** 3}")
        except RuntimeError as exc:
            problems.append(f"GPU {i} failed a matmul: {' '.join(str(exc).split())[:200]}")
    return not problems, "; ".join(problems) or f"{count} GPU(s) healthy{' (' + seen + ')' if seen else ''}"


def check_numactl() -> tuple[bool, str]:
    """numactl runs here: `torchrun --numa-binding` starts every worker under it, and without it
    torchrun stops before any rank starts (torch does not fall back to no binding)."""
    shown, why = numactl_show()
    if shown is None:
        return False, (f"{why}: the launch binds each rank to its GPU's NUMA node (launch.preset with torchrun "
                       "--numa-binding), which runs every worker under numactl: rebuild the image (`slipway image "
                       "build CONFIG` installs numactl where the config binds NUMA nodes) or set launch.preset: none")
    _log(f"numactl --show: {shown}")
    return True, "numactl runs"


def check_gpu_numa(gpus: int, bind: bool) -> Optional[tuple[bool, str]]:
    """Each GPU's NUMA node to the log; where the launch binds, a GPU whose node holds no usable CPU
    refused. None where torch sees no GPU (check_gpus says so)."""
    import torch

    count = min(gpus, torch.cuda.device_count()) if torch.cuda.is_available() else 0
    if not count:
        return None
    ok, lines = numa_binding(gpu_pci_addresses(count), os.sched_getaffinity(0))
    for line in lines[0 if ok else 1:]:
        _log(line)
    if not bind:
        return None
    return (True, "every GPU's NUMA node has CPUs to bind to") if ok else (False, lines[0])


def _log(text: str) -> None:
    """A line for the step's log, on stderr: stdout carries the one report line the batch script reads."""
    print(f"slipway-preflight-log {node_name()}: {text}", file=sys.stderr, flush=True)


def node_checks(run_dir: Path, checkpoint_dir: Path, needed_bytes: int, gpus: int,
                binds_numa: bool = False) -> tuple[bool, str]:
    results = [check_run_dir(run_dir), check_free_space(checkpoint_dir, needed_bytes)]
    if results[1][0]:  # room there: how fast it takes a checkpoint
        results.append(check_write_speed(checkpoint_dir, needed_bytes))
    if binds_numa:
        results.append(check_numactl())
    if gpus:
        results.append(check_gpus(gpus))
        numa = check_gpu_numa(gpus, binds_numa)
        results += [numa] if numa else []
    failed = [text for ok, text in results if not ok]
    return not failed, "; ".join(failed or [text for _, text in results])


# ---------------------------------------------------------------- the collective


def all_reduce_check(megabytes: float, timeout_s: float) -> tuple[bool, str]:
    """`sum_across_ranks` in a process group of its own (the separate step of a `train.script`)."""
    if (env_count("WORLD_SIZE") or env_count("SLURM_NTASKS") or 1) == 1:  # torchrun's, else Slurm's
        return True, "a single rank: no collective to test"
    from trainer.parallel import distributed_session

    with distributed_session(timedelta(seconds=timeout_s)) as env:
        return sum_across_ranks(megabytes, 3, env.device)


def sum_across_ranks(megabytes: float, iters: int, device) -> tuple[bool, str]:
    """`time_all_reduce` checked and said in one line, with the bus bandwidth (the rate each link
    carried, NCCL's busbw)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return True, "a single rank: no collective to test"
    nodes: list[Optional[str]] = [None] * world
    dist.all_gather_object(nodes, node_name())
    wrong, numel, per, bus_gbs = time_all_reduce(megabytes, iters, device)
    if wrong:
        return False, f"the sum of {world} ranks was wrong in {wrong} of {numel} elements on rank {rank} ({node_name()})"
    return True, (f"all-reduce of {megabytes:g} MiB over {world} ranks on {len(set(nodes))} node(s) "
                  f"({dist.get_backend()}): {bus_gbs:.2f} GB/s bus bandwidth, {per * 1e3:.1f} ms each")


def time_all_reduce(megabytes: float, iters: int, device) -> tuple[int, int, float, float]:
    """(elements summed wrong, elements, seconds an all-reduce, bus bandwidth in GB/s) of `iters`
    all-reduces of `megabytes` of float32 ones in the default group, after one warm-up."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    numel = max(1, int(megabytes * 2**20) // 4)
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(buf)  # warm-up: connections, buffers
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        buf.fill_(1.0)
        dist.all_reduce(buf)
    sync()
    per = (time.perf_counter() - t0) / iters
    wrong = int((buf != float(world)).sum().item())
    return wrong, numel, per, numel * 4 / per * 2 * (world - 1) / world / 1e9


def _answer(check: Callable[[], tuple[bool, str]], rank: str) -> tuple[bool, str]:
    try:
        return check()
    except Exception as exc:  # any failure of the collective is the answer, on one line
        return False, f"rank {rank} on {node_name()}: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"


class AllReduceGate:
    """The preflight's all-reduce as the training step's first collective (the module's doc). `arm()`
    before the process group forms starts the bound: a rank with no result `timeout_s` later (a
    rendezvous or NCCL set-up that never completes, a collective that never returns) fails. `check()`
    once the group is up runs it; rank 0 records a pass in events.log. A failed check never reaches
    the data, the model or a checkpoint."""

    def __init__(self, megabytes: float, timeout_s: float, env: Mapping[str, str], exit=os._exit) -> None:
        self.megabytes, self.timeout_s = megabytes, timeout_s
        self.rank = env.get("RANK", env.get("SLURM_PROCID", "0"))
        self.run_dir = env.get("SLIPWAY_RUN_DIR")
        self.reports = env.get("SLIPWAY_EXITS")
        self.job = event_job(env)
        self.nodelist = env.get("SLURM_JOB_NODELIST") or node_name()
        self._exit = exit
        self._timer: Optional[threading.Timer] = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> Optional["AllReduceGate"]:
        """The gate the batch script asked for (PREFLIGHT_ENV = "MEGABYTES TIMEOUT_S"), else None."""
        value = env.get(PREFLIGHT_ENV, "").split()
        if not value:
            return None
        try:
            megabytes, timeout_s = float(value[0]), float(value[1])
        except (IndexError, ValueError):
            raise ValueError(f"{PREFLIGHT_ENV}={env[PREFLIGHT_ENV]!r}: expected 'MEGABYTES TIMEOUT_S'") from None
        return cls(megabytes, timeout_s, env)

    def arm(self) -> "AllReduceGate":
        self._timer = threading.Timer(self.timeout_s, self._timed_out)
        self._timer.daemon = True
        self._timer.start()
        return self

    def check(self, device) -> None:
        ok, text = _answer(lambda: sum_across_ranks(self.megabytes, 3, device), self.rank)
        if not ok:
            self.fail(text)
            return
        if self._timer is not None:
            self._timer.cancel()
        if self.rank == "0" and self.run_dir:
            append_event(self.run_dir, self.job, f"preflight ok on {self.nodelist}: {text}")

    def _timed_out(self) -> None:
        self.fail(f"the all-reduce across every rank gave no result within {self.timeout_s:g} s "
                  f"(rank {self.rank} on {node_name()} waited)")

    def fail(self, text: str) -> None:
        """Report `text` (the first failing rank's report is the one kept) and exit PREFLIGHT_EXIT
        at once: a collective that failed may never let the process group be torn down."""
        print(f"slipway-preflight-allreduce fail: {text}", file=sys.stderr, flush=True)
        # Another rank reported first, the directory is gone or the disk is full: the exit comes all the same.
        with contextlib.suppress(OSError):
            if self.reports:
                fd = os.open(Path(self.reports) / PREFLIGHT_FAILED_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                with os.fdopen(fd, "w") as f:
                    f.write(" ".join(text.split()) + "\n")
        sys.stdout.flush()
        self._exit(PREFLIGHT_EXIT)


# ---------------------------------------------------------------- the command line


def main(argv: Optional[list[str]] = None) -> int:
    parser = Parser(prog="python -m trainer.preflight", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    node = sub.add_parser("node", help="this node's checks (one task per node)")
    node.add_argument("--run-dir", type=Path, required=True)
    node.add_argument("--checkpoint-dir", type=Path, required=True)
    node.add_argument("--checkpoint-bytes", type=int, required=True, help="room one more checkpoint needs")
    node.add_argument("--gpus", type=int, default=0, help="GPUs this node must have (0: a CPU job)")
    node.add_argument("--numa-binding", action="store_true", help="the launch binds NUMA nodes: numactl must run")
    ar = sub.add_parser("allreduce", help="a short all-reduce across every rank, in a step of its own (a train.script's)")
    ar.add_argument("--megabytes", type=float, default=4.0)
    ar.add_argument("--timeout", type=float, default=300.0, help="seconds the process group may take to form")
    args = parser.parse_args(argv)
    if args.what == "node":
        ok, text = node_checks(args.run_dir, args.checkpoint_dir, args.checkpoint_bytes, args.gpus, args.numa_binding)
        print(f"slipway-preflight {node_name()} {'ok' if ok else 'fail'}: {text}", flush=True)
        return 0 if ok else PREFLIGHT_EXIT
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    ok, text = _answer(lambda: all_reduce_check(args.megabytes, args.timeout), rank)
    if rank == "0" or not ok:
        print(f"slipway-preflight-allreduce {'ok' if ok else 'fail'}: {text}", flush=True)
    return 0 if ok else PREFLIGHT_EXIT


if __name__ == "__main__":
    sys.exit(main())
