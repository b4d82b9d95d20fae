"""The config's slurm: and launch: sections: the allocation a job asks of Slurm (its sbatch options,
time limit, requeues, retries and preflight) and how the ranks start in it (launcher, processes,
interpreter, environment, node preset). jobs/config/ composes them into the one config tree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from common.errors import ConfigError, shown
from common.schema import FREE_TEXT, at_most, positive, require
from common.secrets import OWN_TEXT, TEXT, find_secrets
from edf.environment import ENV_NAME

# Slurm's time formats (sbatch --time): MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
TIME_FORMS = re.compile(r"(?P<m>\d+)(:(?P<s>\d+))?|(?P<h3>\d+):(?P<m3>\d+):(?P<s3>\d+)|"
                        r"(?P<d>\d+)-(?P<dh>\d+)(:(?P<dm>\d+)(:(?P<ds>\d+))?)?")
UNLIMITED = ("unlimited", "infinite")
TIME_RULE = "use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"
# The longest limit slipway submits (Slurm itself stores minutes in 32 bits; no partition allows
# more than this, and the batch script's arithmetic on it stays far from bash's limits).
MAX_TIME_SECONDS = 365 * 86400
# Slurm's --signal takes at most 65535 seconds (sbatch(1)).
MAX_SIGNAL_SECONDS = 65535
# sbatch --mem: a whole number of megabytes, or of K, M, G or T (Slurm's str_to_mbytes); 0 asks
# for all of a node's memory. A sign, a fraction or an exponent is no size Slurm reads.
MEM_FORM = re.compile(r"([0-9]{1,16})([KMGT]?)", re.IGNORECASE)
MAX_MEM_MB = 1 << 30  # a PiB: more than any node has
MEM_RULE = "a whole number with an optional unit K, M, G or T, such as 200G or 200000M (0: all of a node's memory)"


def mem_megabytes(text: str) -> int:
    """Megabytes in a Slurm memory size (`200G`, `512`, `0`); ValueError if it is not one."""
    m = MEM_FORM.fullmatch(text)
    if m is None:
        raise ValueError(text)
    number, unit = int(m.group(1)), m.group(2).upper()
    if unit == "K":
        return (number + 1023) // 1024
    return number * {"": 1, "M": 1, "G": 1 << 10, "T": 1 << 20}[unit]


def time_limit_seconds(text: str) -> Optional[int]:
    """Seconds in a Slurm time limit, None for no limit; ValueError if it is not one."""
    if text.strip().lower() in UNLIMITED:
        return None
    m = TIME_FORMS.fullmatch(text.strip()) if len(text) <= 40 else None
    if m is None:
        raise ValueError(text)
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    if "d" in g:
        return g["d"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0)
    if "h3" in g:
        return g["h3"] * 3600 + g["m3"] * 60 + g["s3"]
    return g["m"] * 60 + g.get("s", 0)


def _parsed(parse: Callable[[str], Any], value: str, where: str, form: str) -> Any:
    """`parse(value)`, a value it refuses said as field `where`'s error, naming Slurm's `form`."""
    try:
        return parse(value)
    except ValueError:
        raise ConfigError(where, f"{shown(value)} is not a Slurm {form}") from None


@dataclass
class SlurmSection:
    """The Slurm allocation: the job's sbatch options, its time-limit requeues, failure retries and
    preflight, and the data preparation job."""

    # Nodes of the allocation.
    nodes: int = 1
    # GPUs per node; 0 for a CPU run.
    gpus_per_node: int = 4
    # Default: 8, or what launch.preset gives (a GH200 rank gets its Grace's 72 cores).
    cpus_per_task: Optional[int] = None
    # The time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED.
    time: str = "01:00:00"
    # sbatch --account; null: Slurm's default.
    account: Optional[str] = None
    # sbatch --partition; null: Slurm's default.
    partition: Optional[str] = None
    # sbatch --qos; null: Slurm's default.
    qos: Optional[str] = None
    # Mail this address when the job ends or fails.
    email: Optional[str] = None
    # sbatch --mem: memory per node in Slurm's form, a whole number with an optional unit K, M,
    # G or T (200G, 200000M; 0: all of it); null: the partition's default.
    mem: Optional[str] = None
    # Relative to the run directory; %j is the job id (known before the log is read).
    output: str = "logs/%j.out"
    # Slurm's error log, relative to the run directory like output.
    error: str = "logs/%j.err"
    # Seconds before the time limit at which the batch script asks the trainer to save at the step
    # boundary (the job then requeues itself). Default (null): measured, the warning lead: the
    # run's slowest recent save plus the steps to the next stop point plus a margin (before the
    # first save, the checkpoint's size at the write speed the preflight measured; with neither, a
    # tenth of the limit, at most 300 s), at least Slurm's own warning (a tenth, at most 60 s) and
    # at most half the limit, recomputed through the job (docs/runs.md). A number fixes it (Slurm's
    # --signal); 0 disables the warning.
    signal_seconds: Optional[int] = None
    # Whether the job requeues itself (sbatch --requeue): off, it neither requeues at the
    # time-limit warning nor retries a failure.
    requeue: bool = True
    # Time-limit requeues of one job before it stops requeueing (recorded in events.log).
    max_requeues: int = 20
    # Failure retries, counted apart from max_requeues: when a node failed the preflight, a run
    # hung (train.hang_timeout) or a node died, the job requeues itself without the nodes to
    # blame (where the partition has enough others), at most this many times; each decision
    # and its reason go to events.log. 0: never retry.
    max_retries: int = 2
    # Before training, every node checks the run directory, free space for checkpoints and its
    # GPUs (a step of its own); then every rank joins a short all-reduce, as the training step's
    # first collective (a train.script: a step of its own) (trainer/preflight.py). A failing
    # node is named and the job retried without it. Skipped with launch.command (its image may
    # not hold slipway's trainer). Each of its two parts may take preflight_timeout seconds.
    preflight: bool = True
    # Seconds each of the preflight's two parts (the node checks, the all-reduce) may take.
    preflight_timeout: int = 300
    # More sbatch options, each one long option such as --exclusive or --mem=0.
    extra: list[str] = field(default_factory=list, metadata={"secrets": TEXT})
    # The data preparation job (`slipway prepare --as-job`, `submit --prepare`): one CPU task,
    # no GPU. Defaults: the training job's partition and cpus_per_task.
    prepare_partition: Optional[str] = None
    # The preparation job's CPUs (its tokenizer threads).
    prepare_cpus: Optional[int] = None
    # The preparation job's time limit.
    prepare_time: str = "02:00:00"

    def check(self, where: str) -> None:
        positive(self, where, "nodes", "preflight_timeout")
        require(self.gpus_per_node >= 0, f"{where}.gpus_per_node", f"must be >= 0, got {self.gpus_per_node}")
        require(self.cpus_per_task is None or self.cpus_per_task > 0, f"{where}.cpus_per_task",
                f"must be > 0, got {self.cpus_per_task}")
        limit = _parsed(time_limit_seconds, self.time, f"{where}.time", f"time limit: {TIME_RULE}")
        require(limit is None or limit > 0, f"{where}.time", f"must be longer than 0, got {shown(self.time)}")
        require(limit is None or limit <= MAX_TIME_SECONDS, f"{where}.time",
                f"{shown(self.time)} is longer than 365 days (365-00:00:00): lower it, or write UNLIMITED")
        at_most(self, where, nodes=100_000, gpus_per_node=64, cpus_per_task=4096, prepare_cpus=4096,
                max_requeues=1000, max_retries=100, preflight_timeout=86400)
        if self.signal_seconds is not None:
            require(self.signal_seconds >= 0, f"{where}.signal_seconds", "must be >= 0 (0 disables the warning)")
            require(self.signal_seconds <= MAX_SIGNAL_SECONDS, f"{where}.signal_seconds",
                    f"must be at most {MAX_SIGNAL_SECONDS} (Slurm's --signal limit), got {self.signal_seconds}")
            require(limit is None or self.signal_seconds * 2 <= limit, f"{where}.signal_seconds",
                    f"the warning {self.signal_seconds} s before the end must leave at least half of slurm.time "
                    f"({self.time} = {limit} s) for training, or every requeued job would save and stop at once: "
                    f"lower signal_seconds to {limit // 10 if limit else 0} or raise slurm.time")
        require(self.max_requeues >= 0, f"{where}.max_requeues", f"must be >= 0, got {self.max_requeues}")
        require(self.max_retries >= 0, f"{where}.max_retries", f"must be >= 0 (0: never retry), got {self.max_retries}")
        require(self.prepare_cpus is None or self.prepare_cpus > 0, f"{where}.prepare_cpus",
                f"must be > 0, got {self.prepare_cpus}")
        prepare_limit = _parsed(time_limit_seconds, self.prepare_time, f"{where}.prepare_time",
                                f"time limit: {TIME_RULE}")
        require(prepare_limit is None or 0 < prepare_limit <= MAX_TIME_SECONDS, f"{where}.prepare_time",
                f"must be longer than 0 and at most 365 days, got {shown(self.prepare_time)}")
        for name in ("output", "error"):
            value = getattr(self, name)
            require(bool(value) and "\n" not in value and not value.startswith("/")
                    and ".." not in Path(value).parts, f"{where}.{name}",
                    f"must be a path inside the run directory such as logs/%j.out, got {shown(value)}")
        for i, opt in enumerate(self.extra):
            require(opt.startswith("--") and "\n" not in opt, f"{where}.extra[{i}]",
                    f"must be one long sbatch option such as --exclusive or --mem=0, got {shown(opt)}")
        if self.mem is not None:
            require(_parsed(mem_megabytes, self.mem, f"{where}.mem", f"memory size: {MEM_RULE}") <= MAX_MEM_MB,
                    f"{where}.mem", f"{shown(self.mem)} is more memory than any node has: {MEM_RULE}")
        for name in ("account", "partition", "qos", "email", "prepare_partition"):
            value = getattr(self, name)
            require(value is None or (bool(value) and "\n" not in value and (name == "partition" or "," not in value)),
                    f"{where}.{name}", f"must be a single line without commas, got {shown(value)}")

    def time_seconds(self) -> Optional[int]:
        return time_limit_seconds(self.time)

    def warning_seconds(self) -> int:
        """When Slurm warns the batch script before the limit (#SBATCH --signal; 0: never): the
        fixed signal_seconds, else the measured lead's floor (`warning_bounds`)."""
        if self.signal_seconds is not None:
            return self.signal_seconds
        bounds = self.warning_bounds()
        return bounds[0] if bounds else (300 if self.time_seconds() is None else 0)

    def warning_bounds(self) -> Optional[tuple[int, int, int]]:
        """The measured warning lead's (floor, default before any measurement, ceiling) in seconds;
        None when it is not measured (a fixed signal_seconds, no time limit, a limit too short)."""
        limit = self.time_seconds()
        if self.signal_seconds is not None or limit is None:
            return None
        default = min(300, max(10, limit // 10))
        if default * 2 > limit:
            return None
        return min(60, default), default, limit // 2


@dataclass(frozen=True)
class NodePreset:
    """A node type slipway knows: its GPUs and cores, how ranks bind to them, its network's settings."""

    gpus: int
    cores: int  # per node
    env: tuple[tuple[str, str], ...]  # exported before srun (an image's own values win under the CE)
    what: str
    capability: str = ""  # its GPUs' CUDA compute capability, which the image's kernels must serve


NODE_PRESETS = {
    # CSCS Alps: 4 GH200 (Grace CPU + Hopper GPU, one NUMA node of 72 cores each), Slingshot.
    # The variables are the CSCS NCCL page's (eth-cscs/cscs-docs docs/software/communication/nccl.md):
    # NCCL_NET makes a missing aws-ofi-nccl plugin a hard error instead of a silent, ~20x slower
    # fall-back to TCP sockets.
    "alps-gh200": NodePreset(gpus=4, cores=288, what="CSCS Alps GH200 node (4 x Grace Hopper, Slingshot)",
                             capability="9.0", env=(
        ("NCCL_NET", "AWS Libfabric"),
        ("NCCL_NET_GDR_LEVEL", "PHB"),
        ("NCCL_CROSS_NIC", "1"),
        ("NCCL_PROTO", "^LL128"),
        ("FI_CXI_DEFAULT_CQ_SIZE", "131072"),
        ("FI_CXI_DEFAULT_TX_SIZE", "16384"),
        ("FI_CXI_DISABLE_HOST_REGISTER", "1"),
        ("FI_CXI_RX_MATCH_MODE", "software"),
        ("FI_MR_CACHE_MONITOR", "userfaultfd"),
    )),
}


@dataclass
class LaunchSection:
    """How the training command starts inside the allocation."""

    # How the ranks start. srun: one task per process, RANK/LOCAL_RANK/WORLD_SIZE mapped from
    # SLURM_*; torchrun: one agent per node, c10d rendezvous; auto: srun for slipway's trainer
    # (it needs nothing of torchrun's, and slipway asks torchrun for no elastic restarts, so its
    # agents only cost a process and a rendezvous per node), torchrun for a train.script or a
    # launch.command started by launch.python (the user's program may read torchrun's own
    # variables). `slipway submit --dry-run` says which, and why.
    launcher: Literal["auto", "torchrun", "srun"] = "auto"
    # Processes per node; default: gpus_per_node (or 1 without GPUs).
    procs_per_node: Optional[int] = None
    # The interpreter that runs the trainer; default: python3 in a container,
    # this environment's own interpreter with runtime none.
    python: Optional[str] = None
    # Replace the trainer with another command (a list of arguments).
    command: list[str] = field(default_factory=list, metadata={"secrets": TEXT, **FREE_TEXT})
    # Shell lines the batch script runs as written before it launches the ranks (your own text: a
    # value in them that looks like a secret is warned about, not refused; docs/secrets.md).
    pre_launch: list[str] = field(default_factory=list, metadata={"secrets": OWN_TEXT})
    # Variables exported before srun; they override the node preset's. A name or value that looks
    # like a secret's is refused: pass secrets with container.env_from_host instead.
    env: dict[str, str] = field(default_factory=dict, metadata={"secrets": TEXT, **FREE_TEXT})
    # set -x in the batch script, CUDA_LAUNCH_BLOCKING=1, TORCH_DISTRIBUTED_DEBUG=DETAIL, NCCL_DEBUG=INFO.
    debug: bool = False
    # The Hugging Face cache (HF_HOME) of the job and of `slipway prepare`; default: the project's
    # .cache/huggingface.
    hf_home: Optional[str] = None
    # A node type (NODE_PRESETS): binds each rank to the cores and memory next to its GPU
    # (srun --cpu-bind with launcher srun, torchrun --numa-binding with torchrun) and sets the
    # network's communication variables. `none`: nothing of the kind.
    preset: Literal["none", "alps-gh200"] = "none"
    # `slipway run`: keep, per node and allocation, a warm process that has imported torch and the
    # rest of what the trainer imports, and start each rank from it (the run's code, process group
    # and model still fresh). It ends with the allocation, or on `slipway run --stop-warm`.
    warm: bool = True
    # Seconds a stop of `slipway local` or `slipway run` (Ctrl-C, SIGTERM) gives the ranks to save
    # before it kills them, unsaved; null: twice what they need, from the run's step and save times
    # (at least 90 s), said on the stop's first line.
    stop_grace: Optional[float] = None

    def check(self, where: str) -> None:
        require(self.procs_per_node is None or self.procs_per_node > 0, f"{where}.procs_per_node",
                f"must be > 0, got {self.procs_per_node}")
        require(self.stop_grace is None or 0 < self.stop_grace <= 30 * 86400, f"{where}.stop_grace",
                f"must be seconds > 0 (null: sized from the run's steps and saves), got {self.stop_grace}")
        for key in self.env:
            require(bool(ENV_NAME.fullmatch(key)), f"{where}.env.{key}",
                    "is not a valid environment variable name (letters, digits, _; not starting with a digit)")

    def secret_warnings(self, where: str = "launch") -> list[str]:
        """pre_launch lines holding what looks like a secret: written into config.yaml and job.sbatch
        as the user wrote them, so said (the line, never the value) rather than refused."""
        return [f"{where}.pre_launch[{i}] holds what looks like {found[0].what}: it is written into config.yaml "
                "and job.sbatch as you wrote it (and traced under launch.debug); export it in the shell you submit "
                "from and pass it with container.env_from_host instead"
                for i, line in enumerate(self.pre_launch) if (found := find_secrets(line))]
