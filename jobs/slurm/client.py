"""The one wrapper around Slurm's client tools (sbatch, squeue, sacct, scancel, scontrol, sinfo, srun),
through plumbum, so a test can read every command line. Accounting (`sacct`) is optional: many small
clusters and the local test cluster run without it, and a job slurmctld forgot is then told by
events.log alone.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from plumbum import local
from plumbum.commands.processes import ProcessExecutionError, ProcessTimedOut

from common.errors import ConfigError, shown, warn
from common.yaml import read_text_bounded

ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED",
                 "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED"}


class SlurmError(RuntimeError):
    """A Slurm command failed; the message carries Slurm's own words."""


@dataclass
class JobInfo:
    job_id: str
    state: str
    exit_code: str = ""
    reason: str = ""  # why it waits or ended ("" for scontrol's None)
    elapsed: str = ""
    nodes: str = ""
    name: str = ""

    @property
    def active(self) -> bool:
        return self.state.split()[0] in ACTIVE_STATES if self.state else False

    @property
    def return_code(self) -> int | None:
        """The job's exit code as a shell would see it (signals as 128+N)."""
        code, colon, sig = self.exit_code.partition(":")
        if not colon:
            return None
        return 128 + int(sig) if int(sig or 0) else int(code or 0)


def available(tool: str) -> bool:
    return shutil.which(tool) is not None


def tool(name: str):
    """`name` to run through plumbum, refused where it is not on PATH."""
    if not available(name):
        raise SlurmError(f"{name} not found on PATH: run slipway on a Slurm login node (or `make cluster-up` "
                         "for a local test cluster)")
    return local[name]


def _run(cmd, *args: str) -> str:
    try:
        return cmd[args]()
    except ProcessExecutionError as exc:
        msg = " ".join((exc.stderr or exc.stdout or "").split())
        raise SlurmError(f"{cmd.executable.name} failed (exit {exc.retcode}): {msg}") from None


# sbatch's input variables (sbatch(1), INPUT ENVIRONMENT VARIABLES) outrank a script's #SBATCH lines.
# Cleared for the call, each one said: those for an option the batch script states. The config
# decided it, the run records it and the job's arithmetic depends on it (the time limit, the log
# paths `status` reads, the job name, requeueing); a variable a module left is no decision about this run.
STATED_BY_SCRIPT = {  # variable: (the config key behind the option, the #SBATCH options it competes with)
    "SBATCH_JOB_NAME": ("run.name", "--job-name"), "SBATCH_TIMELIMIT": ("slurm.time", "--time"),
    "SBATCH_SIGNAL": ("slurm.signal_seconds", "--signal"),
    "SBATCH_REQUEUE": ("slurm.requeue", "--requeue", "--no-requeue"),
    "SBATCH_NO_REQUEUE": ("slurm.requeue", "--requeue", "--no-requeue"),
    "SBATCH_OUTPUT": ("slurm.output", "--output"), "SBATCH_ERROR": ("slurm.error", "--error"),
    "SBATCH_OPEN_MODE": ("slurm.output", "--open-mode"), "SBATCH_ACCOUNT": ("slurm.account", "--account"),
    "SBATCH_PARTITION": ("slurm.partition", "--partition"), "SBATCH_QOS": ("slurm.qos", "--qos"),
    "SBATCH_MEM_PER_NODE": ("slurm.mem", "--mem"), "SBATCH_MEM_PER_CPU": ("slurm.mem", "--mem"),
    "SBATCH_MEM_PER_GPU": ("slurm.mem", "--mem"), "SBATCH_GPUS_PER_NODE": ("slurm.gpus_per_node", "--gpus-per-node"),
    "SBATCH_GPUS": ("slurm.gpus_per_node", "--gpus-per-node"),
    "SBATCH_GPUS_PER_TASK": ("slurm.gpus_per_node", "--gpus-per-node"),
    "SBATCH_GPUS_PER_SOCKET": ("slurm.gpus_per_node", "--gpus-per-node"),
    "SBATCH_CPUS_PER_GPU": ("slurm.cpus_per_task", "--cpus-per-task"), "SBATCH_EXCLUSIVE": ("slurm.extra", "--exclusive"),
}
# Refused: what no config key states and slipway cannot honour. The others (an account the config
# leaves out, a reservation, a constraint...) are a site's defaults for what the script leaves to Slurm.
REFUSED_VARIABLES = {
    "SBATCH_ARRAY_INX": "it would make an array of the run's job, every task writing the one run directory",
    "SBATCH_WAIT": "sbatch would wait for the job's end before slipway records the job (`submit --show-logs` "
                   "follows one)",
    "SBATCH_CLUSTERS": "the job would go to a cluster that squeue, sacct and scancel here do not ask about",
    "SLURM_CLUSTERS": "the job would go to a cluster that squeue, sacct and scancel here do not ask about",
    "SBATCH_CONTAINER": "Slurm's own container would run the batch script itself (container.runtime runs the "
                        "ranks in the image)",
    "SBATCH_GET_USER_ENV": "the job would take a login shell's environment instead of the one it is submitted "
                           "from (its PATH, container.env_from_host)",
    "SBATCH_EXPORT": "the job would not get the environment it is submitted from (its PATH and interpreter, "
                     "container.env_from_host), as it does not hold ALL; a chosen list belongs in the config, "
                     "as slurm.extra --export=..., which the run records",
}
_SBATCH_LINE = re.compile(r"^#SBATCH\s+(--[a-z-]+)", re.MULTILINE)


def check_sbatch_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse, in one line naming them, the sbatch input variables slipway cannot honour."""
    environ = os.environ if environ is None else environ
    refused = [name for name in REFUSED_VARIABLES if environ.get(name)
               and not (name == "SBATCH_EXPORT" and "ALL" in environ[name].split(","))]
    if refused:
        raise ConfigError(f"${refused[0]}", f"set in this shell, where {REFUSED_VARIABLES[refused[0]]}: unset "
                                            f"{' '.join(refused)} and submit again")


def sbatch(script: Path, cwd: Path, after: str | None = None) -> str:
    """Submit `script`; the job id. `after`: a job id this job waits for; it starts only if that one completed."""
    check_sbatch_environment(local.env)
    stated = set(_SBATCH_LINE.findall(read_text_bounded(script, script.name)))
    cleared = [name for name, (_, *options) in STATED_BY_SCRIPT.items()
               if local.env.get(name) and stated & set(options)]
    for name in cleared:
        key, option, *_ = STATED_BY_SCRIPT[name]
        warn(f"${name} is left out of sbatch's environment: {script.name} states {option} from the run's {key}, "
             f"which the run records (set {key} instead)")
    with local.env(), local.cwd(cwd):
        for name in cleared:
            local.env.pop(name, None)
        out = _run(tool("sbatch"), "--parsable", *([f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
                                                    if after else []), str(script))
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed {out.strip()!r} instead of a job id")
    return job_id


def scancel(job_ids: list[str], signal: str | None = None, *, batch: bool = False) -> None:
    """Cancel the jobs, or send them `signal`: to every process of the job (--full), or to the
    batch shell alone (`batch`), whose trap then ends the job itself."""
    scope = ["--batch"] if batch else ["--full"]
    args = ([f"--signal={signal}", *scope] if signal else []) + list(job_ids)
    _run(tool("scancel"), *args)


# squeue's fields, each ended by "|" (no width: nothing is cut); the job name last, as it may hold "|".
# JobArrayID is an array task's ARRAY_TASK (JobID is its own id); --array lists pending tasks one a line.
_SQUEUE_FORMAT = "JobArrayID:|,State:|,Reason:|,TimeUsed:|,NodeList:|,exit_code:|,Name:"
_SACCT_FIELDS = "JobID,State,ExitCode,Elapsed,NodeList,JobName"


def squeue_argv(job_ids: list[str]) -> list[str]:
    return ["squeue", "--noheader", "--array", "--states=all", f"--jobs={','.join(job_ids)}",
            f"--Format={_SQUEUE_FORMAT}"]


def sacct_argv(job_ids: list[str]) -> list[str]:
    return ["sacct", "-j", ",".join(job_ids), "-X", "-n", "-P", "-o", _SACCT_FIELDS]


def _wait_status(text: str) -> str:
    """squeue's exit_code (the job's wait status: 768 for exit 3, 9 for SIGKILL) as CODE:SIGNAL."""
    if not text.strip().isdigit():
        return ""
    status = int(text)
    return f"0:{status & 0x7F}" if status & 0x7F else f"{status >> 8}:0"


def _ask(argv: list[str], timeout: float | None = None) -> str | None:
    """What a query printed; None when it failed (an id slurmctld forgot, no accounting) or its tool is not here."""
    if not available(argv[0]):
        return None
    rc, out, _ = local[argv[0]][argv[1:]].run(retcode=None, timeout=timeout)
    return out if rc == 0 else None


# Job ids per call: a command line argument holds at most 128 KiB (Linux's MAX_ARG_STRLEN).
BATCH = 5000


def _squeue_info(job, state, reason, elapsed, nodes, code, name) -> JobInfo:
    return JobInfo(job, state, _wait_status(code), "" if reason == "None" else reason, elapsed, nodes, name)


def _sacct_info(job, state, code, elapsed, nodes, name) -> JobInfo:
    return JobInfo(job, state, code, "", elapsed, nodes, name)


def jobs_info(job_ids: list[str]) -> dict[str, JobInfo]:
    """The state of each job Slurm knows: one squeue, then one sacct for the jobs slurmctld forgot (up
    to BATCH ids a call; a requeued job's last line counts)."""
    wanted = sorted(set(job_ids), key=lambda j: (len(j), j))  # a command line that reads the same each time
    found: dict[str, JobInfo] = {}
    for argv, fields, info in ((squeue_argv, 7, _squeue_info), (sacct_argv, 6, _sacct_info)):
        missing = [j for j in wanted if j not in found]
        for i in range(0, len(missing), BATCH):
            asked = set(missing[i:i + BATCH])
            # By "\n" alone: a job's name or reason may hold what str.splitlines() also breaks at.
            for line in (_ask(argv(missing[i:i + BATCH])) or "").split("\n"):
                parts = line.split("|", fields - 1)
                if len(parts) == fields and parts[0] in asked:
                    found[parts[0]] = info(*parts)
    return found


def job_info(job_id: str) -> JobInfo | None:
    """State of one job: squeue while slurmctld remembers it, else sacct."""
    return jobs_info([job_id]).get(job_id)


def max_array_size() -> int:
    """The cluster's MaxArraySize (array task indices stay below it; 0: no arrays allowed)."""
    size = cluster_config().get("MaxArraySize")
    if size is None or not size.isdigit() or len(size) > 9:
        said = "names no MaxArraySize" if size is None else f"says MaxArraySize = {shown(size)}, no count of tasks"
        raise SlurmError(f"scontrol show config {said}: is a Slurm controller answering?")
    return int(size)


def job_steps(job_id: str) -> list[tuple[str, str]]:
    """(JOB.STEP, name) of each step of job `job_id` that runs; [] when Slurm does not say."""
    out = _ask(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"]) or ""
    return [(parts[0], parts[1]) for line in out.splitlines() if len(parts := line.split(None, 1)) == 2]


def signal_steps(step_ids: list[str], signal: str) -> None:
    _run(tool("scancel"), f"--signal={signal}", *step_ids)


def hostnames(nodelist: str) -> list[str]:
    """The node names of a Slurm host list (`node[1-3,5]`); [] for an empty one or without scontrol."""
    if not nodelist or nodelist in ("(null)", "None"):
        return []
    return (_ask(["scontrol", "show", "hostnames", nodelist]) or "").split()


def responding_nodes(partition: str | None) -> list[str]:
    """The nodes of `partition` (every partition's when None) that answer the controller."""
    out = _run(tool("sinfo"), "-h", "-N", "-r", "-o", "%N", *(["-p", partition] if partition else []))
    return list(dict.fromkeys(out.split()))


# Node states (sinfo %t, its power-saving suffixes ~#% stripped) in which Slurm can place a job: what
# job_lib.sh's retry_or_stop counts as usable too.
USABLE_STATES = ("idle", "mix", "alloc", "comp", "plnd")


def usable_state(state: str) -> bool:
    return state.rstrip("~#%") in USABLE_STATES


def partition_nodes(partition: str | None) -> tuple[str, dict[str, str]]:
    """(the partition, each of its nodes' sinfo state) in one sinfo: `partition`'s, else the
    default partition's (sinfo marks it with a `*`); ("", {}) when there is none."""
    out = _run(tool("sinfo"), "-h", "-N", "-o", "%N|%t|%P")
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
    if partition is None:
        partition = next((p.rstrip("*") for _, _, p in rows if p.endswith("*")), "")
    return partition, {node: state for node, state, p in rows if p.rstrip("*") == partition}


def partitions() -> dict[str, list[tuple[str, str]]]:
    """Each partition's nodes as (name, generic resources: `gpu:4`, `(null)`), in one sinfo."""
    out = _run(tool("sinfo"), "-h", "-N", "-o", "%P|%N|%G")
    found: dict[str, list[tuple[str, str]]] = {}
    for part, node, gres in (line.split("|", 2) for line in out.splitlines() if line.count("|") == 2):
        found.setdefault(part.rstrip("*"), []).append((node, gres))
    return found


def associations(user: str) -> list[tuple[str, str]] | None:
    """(account, QoS list) of each of `user`'s associations (sacctmgr); None without accounting."""
    out = _ask(["sacctmgr", "-n", "-P", "show", "associations", f"user={user}", "format=account,qos"], 30)
    return None if out is None else [tuple(line.split("|", 1)) for line in out.splitlines() if "|" in line]


def cluster_config() -> dict[str, str]:
    """`scontrol show config` as key -> value ({} without an answer)."""
    out = _ask(["scontrol", "show", "config"], 30) or ""
    return {k.strip(): v.strip() for k, sep, v in (line.partition("=") for line in out.splitlines()) if sep}


def ping(timeout: float = 20) -> tuple[bool, str]:
    """Whether a Slurm controller answers (`scontrol ping`), and what it said."""
    if not available("scontrol"):
        return False, "scontrol not on PATH"
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # scontrol would spend its timeout looking for a controller elsewhere
        return False, f"SLURM_CONF={shlex.quote(conf)} is not a file"
    try:
        rc, out, err = local["scontrol"]["ping"].run(retcode=None, timeout=timeout)
    except ProcessTimedOut:
        return False, f"scontrol ping got no answer in {timeout:.0f} s"
    # Without the banner scontrol prints under a controller that is down (rows of asterisks).
    text = " ".join(w for w in (out + " " + err).split() if w.strip("*"))
    # Without a configuration scontrol logs each source it tried; its fatal line says why it gave up.
    fatal = [line.strip() for line in err.splitlines() if "fatal:" in line]
    return rc == 0 and " is UP" in text, (fatal[-1] if fatal else text) or f"scontrol ping exited {rc}"


def srun_argv(*, nodes: int, cpus_per_task: int, ntasks_per_node: int = 1, ntasks: int | None = None,
              gpus_per_node: int = 0, overlap: bool = False, kill_on_bad_exit: bool | None = None,
              wait: int | None = None, near_gpu: bool = False, time: str | None = None, account: str | None = None,
              partition: str | None = None, pty: bool = False, container: Sequence[str] = (),
              extra: Sequence[str] = ()) -> list[str]:
    """Every srun slipway starts, its options in one order. `wait`: seconds for the other tasks once one
    ends; `near_gpu`: each task on a GPU of its own and the cores and memory next to it (a node
    preset); `time`, `account`, `partition`: a one-off's own allocation; `extra`: more options, the
    command. Each word is returned as given (a `str` subclass stays one), so a script quotes it by kind."""
    argv = ["srun", *(["--overlap"] if overlap else [])]
    argv += [] if kill_on_bad_exit is None else [f"--kill-on-bad-exit={int(kill_on_bad_exit)}"]
    argv += [] if wait is None else [f"--wait={wait}"]
    # The task count in full with the count per node: srun takes a missing one from the allocation's
    # SLURM_NTASKS, and then ignores --ntasks-per-node (a step of one task per node ran one per rank).
    argv += [f"--nodes={nodes}", *([f"--ntasks={ntasks}"] if ntasks else
                                   [f"--ntasks={nodes * ntasks_per_node}", f"--ntasks-per-node={ntasks_per_node}"]),
             f"--cpus-per-task={cpus_per_task}", *([f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else [])]
    argv += ["--gpus-per-task=1", "--cpu-bind=verbose,cores", "--mem-bind=local"] if near_gpu else []
    argv += [f"--{name}={value}" for name, value in (("time", time), ("account", account), ("partition", partition))
             if value]
    return argv + (["--pty"] if pty else []) + [*container, *extra]
