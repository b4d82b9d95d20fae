"""Slurm's client tools as stand-ins that count their calls, for tests and bench/status.py.

Each tool is a bash script in `bin/` that logs its argument list to `calls` and answers from
files: `ctld` holds the jobs slurmctld still knows, `acct` those the accounting database
knows, a line `ID|STATE|EXITCODE|REASON|ELAPSED|NODELIST|NAME` each (a job's latest line counts). sbatch queues a new job
PENDING (an array's tasks, as ID_TASK), scancel cancels, squeue and `scontrol show job` answer from ctld, sacct from acct
(or fails as Slurm without accounting does, when `no-accounting` exists); `scontrol show config`
gives MaxArraySize from `max-array-size` (1001, Slurm's default, without it). They answer the
command lines jobs/slurm/__init__.py builds, and print what Slurm 22.05 prints for them (squeue's
exit_code is the wait status: 768 for exit 3, 9 for SIGKILL; one unknown id is an error, several not).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

LOG = 'echo "$(basename "$0") $*" >> "$STANDIN/calls"\n'
# The latest record of each job id of $2 (comma-separated) in file $1: ID|STATE|EXITCODE|REASON|ELAPSED|NODES|NAME.
LATEST = """latest() { [ -f "$1" ] || return 0; echo "$2" | tr ',' '\\n' |
  awk -F'|' 'NR == FNR { want[$1]; next } ($1 in want) { last[$1] = $0 } END { for (id in last) print last[id] }' - "$1"; }
"""
TOOLS = {
    # An array (#SBATCH --array=0-N[%K] in the script) queues its tasks, ID_0 ... ID_N.
    "sbatch": LOG + """n=$(( $(cat "$STANDIN/next" 2>/dev/null || echo 1000) + 1 )); echo "$n" > "$STANDIN/next"
last=$(sed -n 's/^#SBATCH --array=0-\\([0-9]*\\).*/\\1/p' "${@: -1}" 2>/dev/null | head -n1)
if [ -n "$last" ]; then for i in $(seq 0 "$last"); do echo "${n}_$i|PENDING|0:0|None|0:00||job" >> "$STANDIN/ctld"; done
else echo "$n|PENDING|0:0|None|0:00||job" >> "$STANDIN/ctld"; fi; echo "$n"
""",
    # A signal to the batch shells ends the job (its trap does), unless `deaf` exists: a shell that never answers.
    "scancel": LOG + LATEST + """case "$1" in --signal=*) [ -e "$STANDIN/deaf" ] && exit 0 ;; esac
ids=$(printf '%s,' "$@" | sed 's/-[^,]*,//g')
latest "$STANDIN/ctld" "$ids" | awk -F'|' -v OFS='|' '{ $2 = "CANCELLED"; $3 = "0:15"; print }' >> "$STANDIN/ctld"
""",
    # squeue --noheader --array --states=all --jobs=ID,... --Format=JobArrayID:|,State:|,Reason:|,TimeUsed:|,NodeList:|,exit_code:|,Name:
    "squeue": LOG + LATEST + """jobs=""
for a in "$@"; do case "$a" in --jobs=*) jobs=${a#--jobs=} ;; esac; done
out=$(latest "$STANDIN/ctld" "$jobs" | awk -F'|' -v OFS='|' '{
  split($3, c, ":"); status = c[2] > 0 ? c[2] : c[1] * 256  # squeue prints the wait status
  print $1, $2, $4, $5, $6, status, $7 }')
case "$jobs" in *,*) ;; *) [ -n "$out" ] || { echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; } ;; esac
[ -z "$out" ] || echo "$out"
""",
    "sacct": LOG + LATEST + """[ -e "$STANDIN/no-accounting" ] && { echo "Slurm accounting storage is disabled" >&2; exit 1; }
jobs=""
while [ $# -gt 0 ]; do case "$1" in -j) jobs=$2; shift ;; esac; shift; done
latest "$STANDIN/acct" "$jobs" | awk -F'|' -v OFS='|' '{ print $1, $2, $3, $5, $6, $7 }'
""",
    "scontrol": LOG + LATEST + """case "$1 $2" in
  "ping ") echo "Slurmctld(primary) at stand-in is UP" ;;
  "show hostnames") echo "$3" | tr ',' '\\n' ;;
  "show config") echo "MaxArraySize            = $(cat "$STANDIN/max-array-size" 2>/dev/null || echo 1001)" ;;
  "show job") line=$(latest "$STANDIN/ctld" "$4")
    [ -n "$line" ] || { echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }
    IFS='|' read -r id s c r e n j <<< "$line"
    echo "JobId=$id JobName=$j JobState=$s Reason=$r ExitCode=$c RunTime=$e NodeList=$n" ;;
esac
""",
}


class StandInSlurm:
    """The stand-ins under `root`; `env` puts them first on PATH."""

    def __init__(self, root: Path, accounting: bool = True):
        self.root = Path(root)
        self.bin = self.root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        for name, body in TOOLS.items():
            path = self.bin / name
            path.write_text("#!/bin/bash\n" + body)
            path.chmod(0o755)
        (self.root / "calls").touch()
        self.accounting = accounting

    @property
    def accounting(self) -> bool:
        return not (self.root / "no-accounting").exists()

    @accounting.setter
    def accounting(self, on: bool) -> None:
        (self.root / "no-accounting").unlink(missing_ok=True) if on else (self.root / "no-accounting").touch()

    def env(self, base: Optional[dict] = None) -> dict[str, str]:
        base = dict(os.environ if base is None else base)
        return {**base, "PATH": f"{self.bin}{os.pathsep}{base.get('PATH', '')}", "STANDIN": str(self.root)}

    def job(self, job_id: str, state: str, exit_code: str = "0:0", *, reason: str = "None",
            elapsed: str = "00:01:00", nodes: str = "node[1-2]", name: str = "job", where: str = "ctld") -> None:
        """Slurm's record of a job: in slurmctld ("ctld"), in accounting ("acct"), or both ("both")."""
        line = f"{job_id}|{state}|{exit_code}|{reason}|{elapsed}|{nodes}|{name}\n"
        for place in (("ctld", "acct") if where == "both" else (where,)):
            with open(self.root / place, "a") as f:
                f.write(line)

    def forget(self, job_id: str) -> None:
        """slurmctld forgets the job (MinJobAge passed); accounting keeps what it has."""
        path = self.root / "ctld"
        if path.exists():
            path.write_text("".join(line for line in path.read_text().splitlines(True)
                                    if line.split("|", 1)[0] != job_id))

    def calls(self, tool: Optional[str] = None) -> list[str]:
        lines = (self.root / "calls").read_text().splitlines()
        return [c for c in lines if tool is None or c.split(" ", 1)[0] == tool]

    def state_calls(self) -> list[str]:
        """The calls that ask about jobs (squeue, sacct, scontrol show job)."""
        return [c for c in self.calls() if c.startswith(("squeue ", "sacct ", "scontrol show job"))]

    def reset_calls(self) -> None:
        (self.root / "calls").write_text("")
