"""The one wrapper around Slurm's client tools (sbatch, squeue, sacct, scancel, scontrol, sinfo, srun).

Every command line is built here, through plumbum, so a test can read it and a
real Slurm runs it. The state of any number of jobs costs at most two calls
(`jobs_info`: one squeue, one sacct for the jobs slurmctld forgot). Accounting
(`sacct`) is optional: many small clusters and the local test cluster run
without it, and a job slurmctld forgot is then told by events.log alone.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from plumbum import local
from plumbum.commands.processes import ProcessExecutionError, ProcessTimedOut

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
        if not self.exit_code or ":" not in self.exit_code:
            return None
        code, _, sig = self.exit_code.partition(":")
        code_i, sig_i = int(code or 0), int(sig or 0)
        return 128 + sig_i if sig_i else code_i


def available(tool: str) -> bool:
    return shutil.which(tool) is not None


def _tool(name: str):
    if not available(name):
        raise SlurmError(f"{name} not found on PATH: run slipway on a Slurm login node (or `make cluster-up` "
                         "for a local test cluster)")
    return local[name]


def _run(cmd, *args: str, cwd: Path | None = None) -> str:
    try:
        if cwd is not None:
            with local.cwd(cwd):
                return cmd[args]()
        return cmd[args]()
    except ProcessExecutionError as exc:
        msg = " ".join((exc.stderr or exc.stdout or "").split())
        raise SlurmError(f"{cmd.executable.name} failed (exit {exc.retcode}): {msg}") from None


def sbatch_argv(script: Path, after: str | None = None) -> list[str]:
    """`after`: a job id this job waits for; it starts only if that one completed (afterok)."""
    return ["sbatch", "--parsable", *([f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"] if after else []),
            str(script)]


def sbatch(script: Path, cwd: Path, after: str | None = None) -> str:
    """Submit `script`; return the job id (cluster suffix stripped)."""
    out = _run(_tool("sbatch"), *sbatch_argv(script, after)[1:], cwd=cwd)
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed {out.strip()!r} instead of a job id")
    return job_id


def scancel(job_ids: list[str], signal: str | None = None, *, batch: bool = False) -> None:
    """Cancel the jobs, or send them `signal`: to every process of the job (--full), or to the
    batch shell alone (`batch`), whose trap then ends the job itself."""
    scope = ["--batch"] if batch else ["--full"]
    args = ([f"--signal={signal}", *scope] if signal else []) + list(job_ids)
    _run(_tool("scancel"), *args)


# squeue's fields, each ended by "|" (no width: nothing is cut); the job name last, as it may hold "|".
_SQUEUE_FORMAT = "JobID:|,State:|,Reason:|,TimeUsed:|,NodeList:|,exit_code:|,Name:"
_SACCT_FIELDS = "JobID,State,ExitCode,Elapsed,NodeList,JobName"


def squeue_argv(job_ids: list[str]) -> list[str]:
    return ["squeue", "--noheader", "--states=all", f"--jobs={','.join(job_ids)}", f"--Format={_SQUEUE_FORMAT}"]


def sacct_argv(job_ids: list[str]) -> list[str]:
    return ["sacct", "-j", ",".join(job_ids), "-X", "-n", "-P", "-o", _SACCT_FIELDS]


def _wait_status(text: str) -> str:
    """squeue's exit_code (the job's wait status: 768 for exit 3, 9 for SIGKILL) as CODE:SIGNAL."""
    if not text.strip().isdigit():
        return ""
    status = int(text)
    return f"0:{status & 0x7F}" if status & 0x7F else f"{status >> 8}:0"


def _ask(argv: list[str]) -> str:
    """What a query printed; "" when it failed (an id slurmctld forgot, no accounting, no answer)."""
    rc, out, _ = local[argv[0]][argv[1:]].run(retcode=None)
    return out if rc == 0 else ""


# Job ids per call: a command line argument holds at most 128 KiB (Linux's MAX_ARG_STRLEN).
BATCH = 5000


def jobs_info(job_ids: list[str]) -> dict[str, JobInfo]:
    """The state of each job Slurm knows, in at most two calls whatever their number (up to BATCH
    ids a call): one squeue for the jobs slurmctld still holds, one sacct for the others (where
    accounting runs)."""
    wanted = sorted(set(job_ids), key=lambda j: (len(j), j))  # a command line that reads the same each time
    found: dict[str, JobInfo] = {}
    if wanted and available("squeue"):
        for i in range(0, len(wanted), BATCH):
            asked = set(wanted[i:i + BATCH])
            for line in _ask(squeue_argv(wanted[i:i + BATCH])).splitlines():
                parts = line.split("|", 6)
                if len(parts) == 7 and parts[0] in asked:
                    job, state, reason, elapsed, nodes, code, name = parts
                    found[job] = JobInfo(job_id=job, state=state, exit_code=_wait_status(code),
                                         reason="" if reason == "None" else reason, elapsed=elapsed, nodes=nodes,
                                         name=name)
    missing = [j for j in wanted if j not in found]
    if missing and available("sacct"):
        for i in range(0, len(missing), BATCH):
            asked = set(missing[i:i + BATCH])
            for line in _ask(sacct_argv(missing[i:i + BATCH])).splitlines():  # a requeued job's last line counts
                parts = line.split("|", 5)
                if len(parts) == 6 and parts[0] in asked:
                    found[parts[0]] = JobInfo(job_id=parts[0], state=parts[1], exit_code=parts[2],
                                              elapsed=parts[3], nodes=parts[4], name=parts[5])
    return found


def job_info(job_id: str) -> JobInfo | None:
    """State of one job: squeue while slurmctld remembers it, else sacct."""
    return jobs_info([job_id]).get(job_id)


def job_steps(job_id: str) -> list[tuple[str, str]]:
    """(JOB.STEP, name) of each step of job `job_id` that runs; [] when Slurm does not say."""
    out = _ask(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"]) if available("squeue") else ""
    return [(parts[0], parts[1]) for line in out.splitlines() if len(parts := line.split(None, 1)) == 2]


def signal_steps(step_ids: list[str], signal: str) -> None:
    """Send `signal` to every process of each step (JOB.STEP)."""
    _run(_tool("scancel"), f"--signal={signal}", *step_ids)


def can_ask() -> bool:
    """Whether any Slurm tool that tells a job's state is here."""
    return available("squeue") or available("sacct")


def hostnames(nodelist: str) -> list[str]:
    """The node names of a Slurm host list (`node[1-3,5]`); [] for an empty one or without scontrol."""
    if not nodelist or nodelist in ("(null)", "None") or not available("scontrol"):
        return []
    try:
        return local["scontrol"]("show", "hostnames", nodelist).split()
    except ProcessExecutionError:
        return []


def responding_nodes(partition: str | None) -> list[str]:
    """The nodes of `partition` (every partition's when None) that answer the controller."""
    out = _run(_tool("sinfo"), "-h", "-N", "-r", "-o", "%N", *(["-p", partition] if partition else []))
    return list(dict.fromkeys(out.split()))


def ping(timeout: float = 20) -> tuple[bool, str]:
    """Whether a Slurm controller answers (`scontrol ping`), and what it said."""
    if not available("scontrol"):
        return False, "scontrol not on PATH"
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
    """Every srun slipway starts, its options in one order: the step's behaviour (`overlap` other
    steps, `kill_on_bad_exit`, `wait` seconds for the other tasks once one ends), its shape
    (`ntasks` in all, else `ntasks_per_node`), `near_gpu` (each task on a GPU of its own and the
    cores and memory next to it: a node preset), a one-off's own allocation (a batch script's
    steps take the job's), the container's flags (`edf.srun_flags`), then `extra` (more options,
    the command). Each word is returned as given (a `str` subclass stays one), so a batch script
    quotes each by its kind."""
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
