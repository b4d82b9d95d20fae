"""The one wrapper around Slurm's client tools (sbatch, squeue, sacct, scancel, scontrol, srun).

Every command line is built here, through plumbum, so a test can read it and a
real Slurm runs it. Accounting (`sacct`) is optional: many small clusters and
the local test cluster run without it, so job state falls back to `scontrol`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

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


def _run(cmd, *args: str, cwd: Path | None = None, retcodes=(0,)) -> str:
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


def requeue(job_id: str) -> None:
    _run(_tool("scontrol"), "requeue", job_id)


def _parse_scontrol(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


def job_info(job_id: str) -> JobInfo | None:
    """State of one job: squeue/scontrol while slurmctld remembers it, else sacct."""
    if available("scontrol"):
        try:
            out = local["scontrol"]("show", "job", "-o", job_id)
        except ProcessExecutionError:
            out = ""
        if out.strip():
            f = _parse_scontrol(out)
            reason = f.get("Reason", "")
            return JobInfo(job_id=job_id, state=f.get("JobState", ""), exit_code=f.get("ExitCode", ""),
                           reason="" if reason == "None" else reason, elapsed=f.get("RunTime", ""),
                           nodes=f.get("NodeList", ""), name=f.get("JobName", ""))
    if available("sacct"):
        try:
            out = local["sacct"]("-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode,Elapsed,NodeList,JobName")
        except ProcessExecutionError:
            out = ""
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) >= 6 and parts[0] == job_id:
                return JobInfo(job_id=job_id, state=parts[1], exit_code=parts[2], elapsed=parts[3],
                               nodes=parts[4], name=parts[5])
    return None


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


def srun_argv(*, nodes: int, ntasks_per_node: int, cpus_per_task: int, gpus_per_node: int, time: str | None,
              account: str | None, partition: str | None, pty: bool, extra: list[str]) -> list[str]:
    """An interactive or one-off `srun` outside a batch script (shell, image builds)."""
    argv = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={ntasks_per_node}", f"--cpus-per-task={cpus_per_task}"]
    if gpus_per_node:
        argv.append(f"--gpus-per-node={gpus_per_node}")
    if time:
        argv.append(f"--time={time}")
    if account:
        argv.append(f"--account={account}")
    if partition:
        argv.append(f"--partition={partition}")
    if pty:
        argv.append("--pty")
    return argv + extra
