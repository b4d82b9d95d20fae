"""Slurm's client tools as stand-ins that count their calls, for tests and bench/status.py.

Each tool is a bash script in `bin/` that logs its argument list to `calls` and answers from
files: `ctld/ID` holds a job slurmctld still knows, `acct/ID` one the accounting database
knows, each one line `STATE|EXITCODE|REASON|ELAPSED|NODELIST|NAME`. sbatch queues a new job
PENDING, scancel cancels, squeue and `scontrol show job` answer from ctld/, sacct from acct/
(or fails as Slurm without accounting does, when `no-accounting` exists). They answer the
command lines jobs/slurm/__init__.py builds, and print what Slurm 22.05 prints for them (squeue's
exit_code is the wait status: 768 for exit 3, 9 for SIGKILL; one unknown id is an error, several not).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

LOG = 'echo "$(basename "$0") $*" >> "$STANDIN/calls"\n'
TOOLS = {
    "sbatch": LOG + """n=$(( $(cat "$STANDIN/next" 2>/dev/null || echo 1000) + 1 )); echo "$n" > "$STANDIN/next"
echo "PENDING|0:0|None|00:00:00||job" > "$STANDIN/ctld/$n"; echo "$n"
""",
    "scancel": LOG + """for id in "$@"; do case "$id" in -*) continue ;; esac
  [ -f "$STANDIN/ctld/$id" ] && IFS='|' read -r s c r e n j < "$STANDIN/ctld/$id" &&
    echo "CANCELLED|0:15|None|$e|$n|$j" > "$STANDIN/ctld/$id"
done
""",
    # squeue --noheader --states=all --jobs=ID,... --Format=JobID:|,State:|,Reason:|,TimeUsed:|,NodeList:|,exit_code:|,Name:
    "squeue": LOG + """jobs=""
for a in "$@"; do case "$a" in --jobs=*) jobs=${a#--jobs=} ;; esac; done
found=0
for id in ${jobs//,/ }; do
  [ -f "$STANDIN/ctld/$id" ] || continue
  IFS='|' read -r s c r e n j < "$STANDIN/ctld/$id"; found=1
  code=${c%%:*} sig=${c##*:}  # squeue prints the wait status: the signal, else the code times 256
  echo "$id|$s|$r|$e|$n|$(( sig ? sig : code * 256 ))|$j"
done
case "$jobs" in *,*) ;; *) [ "$found" = 1 ] || { echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; } ;; esac
""",
    "sacct": LOG + """[ -e "$STANDIN/no-accounting" ] && { echo "Slurm accounting storage is disabled" >&2; exit 1; }
jobs=""
while [ $# -gt 0 ]; do case "$1" in -j) jobs=$2; shift ;; esac; shift; done
for id in ${jobs//,/ }; do
  [ -f "$STANDIN/acct/$id" ] || continue
  IFS='|' read -r s c r e n j < "$STANDIN/acct/$id"
  echo "$id|$s|$c|$e|$n|$j"
done
""",
    "scontrol": LOG + """case "$1 $2" in
  "ping ") echo "Slurmctld(primary) at stand-in is UP" ;;
  "show hostnames") echo "$3" | tr ',' '\\n' ;;
  "show job") id=$4; [ -f "$STANDIN/ctld/$id" ] || { echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }
    IFS='|' read -r s c r e n j < "$STANDIN/ctld/$id"
    echo "JobId=$id JobName=$j JobState=$s Reason=$r ExitCode=$c RunTime=$e NodeList=$n" ;;
esac
""",
}


class StandInSlurm:
    """The stand-ins under `root`; `env` puts them first on PATH."""

    def __init__(self, root: Path, accounting: bool = True):
        self.root = Path(root)
        self.bin = self.root / "bin"
        for sub in ("bin", "ctld", "acct"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
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
        line = f"{state}|{exit_code}|{reason}|{elapsed}|{nodes}|{name}\n"
        for place in (("ctld", "acct") if where == "both" else (where,)):
            (self.root / place / job_id).write_text(line)

    def calls(self, tool: Optional[str] = None) -> list[str]:
        lines = (self.root / "calls").read_text().splitlines()
        return [c for c in lines if tool is None or c.split(" ", 1)[0] == tool]

    def state_calls(self) -> list[str]:
        """The calls that ask about jobs (squeue, sacct, scontrol show job)."""
        return [c for c in self.calls() if c.startswith(("squeue ", "sacct ", "scontrol show job"))]

    def reset_calls(self) -> None:
        (self.root / "calls").write_text("")
