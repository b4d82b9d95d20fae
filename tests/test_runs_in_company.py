"""Reading runs in company (issue 37): one run that cannot be read never hides the others, never
hangs a command and never floods memory, and nothing a file, a job, a run name or Slurm says
reaches the terminal raw. Through the CLI: hostile files (FIFOs, devices, directories where a file
belongs, huge files), a teammate's closed run (a second uid), and a real terminal (tmux)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.runs.manifest import Launch
from common.events import format_event
from other_user import teammate  # noqa: F401,F811 (a fixture)
from slurm_standin import StandInSlurm
from test_status import START, T0, make_run, rows

PY = sys.executable
# A command that blocks on a FIFO fails here instead of hanging the suite.
HANG = 90
# Most a listing or a run command may hold in memory (its peak RSS, KiB), whatever a run's files hold.
MEMORY_KIB = 200 << 10


def slipway(*args: str, env: dict, cwd: Path) -> tuple[subprocess.CompletedProcess, int]:
    """`slipway ARGS` and its peak memory (KiB), measured by a parent of its own."""
    measure = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")
    r = subprocess.run([PY, "-c", measure, PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=HANG,
                       env={**env, "COLUMNS": "300"}, cwd=cwd)
    *lines, peak = r.stderr.rstrip("\n").split("\n")
    r.stderr = "".join(f"{line}\n" for line in lines)
    return r, int(peak)


def done_run(root: Path, name: str, job: str = "11") -> Path:
    run = make_run(root, name, [Launch(job_id=job, submitted=T0, steps=50)], [START, "end exit 0"])
    (run / "logs" / f"{job}.out").write_text("trained\n")
    return run


# What stands in each damaged run's place, and the words its one line says.
DAMAGED = {
    "fifo-events": (lambda run: _replace(run / "events.log", os.mkfifo), "events.log is a FIFO"),
    "zero-events": (lambda run: _replace(run / "events.log", lambda p: p.symlink_to("/dev/zero")),
                    "events.log is a character device"),
    "dir-events": (lambda run: _replace(run / "events.log", Path.mkdir), "events.log is a directory"),
    "fifo-manifest": (lambda run: _replace(run / "manifest.json", os.mkfifo), "manifest.json is a FIFO"),
    "dir-manifest": (lambda run: _replace(run / "manifest.json", Path.mkdir), "manifest.json is a directory"),
    "huge-manifest": (lambda run: _grow(run / "manifest.json", 40 << 20), "larger than 32 MiB"),
    "fifo-metrics": (lambda run: os.mkfifo(run / "metrics.jsonl"), "metrics.jsonl is a FIFO"),
    "newer": (lambda run: (run / "manifest.json").write_text(json.dumps({"schema": 99, "submissions": []})),
              "written by a newer slipway"),
}


def _replace(path: Path, make) -> None:
    path.unlink()
    make(path)


def _grow(path: Path, size: int) -> None:
    with path.open("r+b") as f:  # sparse: a huge file costs nothing to make
        f.truncate(size)


@pytest.fixture
def hostile(project, tmp_path) -> tuple[dict, Path]:
    """Two good runs, each damaged run of DAMAGED, runs with huge or special side files that are
    still runs, and entries of the runs directory that are no runs."""
    slurm = StandInSlurm(tmp_path / "slurm")
    root = project / "runs"
    for name in ("ok1", "ok2"):
        done_run(root, name)
    for name, (damage, _) in DAMAGED.items():
        damage(done_run(root, name))
    big = done_run(root, "huge-events", "12")  # 25 MB of history, then the latest attempt: read from the end
    lines = "".join(format_event("12", f"retry {i}/9 (hang): requeueing", T0) for i in range(200_000))
    (big / "events.log").write_text(lines + format_event("12", START, T0) + format_event("12", "end exit 0", T0))
    _grow(done_run(root, "sparse-events", "13") / "events.log", 2 << 30)  # 2 GiB without a line
    side = done_run(root, "fifo-side-files", "14")  # what watch and status RUN read beside the run's record
    for rel in ("progress.json", "gutil/node1.gutil", "heartbeats", "hangs/14-node1-0.txt", "stop-requested"):
        (side / rel).parent.mkdir(exist_ok=True)
        os.mkfifo(side / rel)
    append_hang = format_event("14", "hang: no step for 600 s; stack dumps in hangs/14-*.txt", T0)
    with (side / "events.log").open("a") as f:
        f.write(append_hang)
    # Entries that are no runs: the code store (closed), a lock, a submission's temporary directory,
    # a stray file, a folder without a manifest, a FIFO.
    (root / ".code" / "c").mkdir(parents=True)
    (root / ".code").chmod(0o000)
    (root / ".ok1.lock").write_text("{}")
    (root / ".new.abc.tmp").mkdir()
    (root / "notes.txt").write_text("hello\n")
    (root / "empty-dir").mkdir()
    os.mkfifo(root / "fifo-entry")
    yield slurm.env(), project
    (root / ".code").chmod(0o755)


GOOD = ("ok1", "ok2", "huge-events", "sparse-events", "fifo-side-files")


def test_a_run_that_cannot_be_read_is_one_line_and_every_other_run_is_listed(hostile):
    env, project = hostile
    r, peak = slipway("status", env=env, cwd=project)
    assert r.returncode == 2, r.stderr
    shown = rows(r.stdout)
    assert sorted(shown) == sorted([*GOOD, *DAMAGED]), r.stdout  # no code store, lock, stray file or FIFO
    for name in GOOD:
        assert shown[name][2] == "COMPLETED" or name == "sparse-events", (name, shown[name])
    errors = r.stderr.splitlines()
    assert len(errors) == len(DAMAGED), r.stderr
    for name, (_, said) in DAMAGED.items():
        assert shown[name][2] == "DAMAGED" and said in shown[name][-1], (name, shown[name])
        assert sum(f"run {name}" in line or f"/{name}/" in line for line in errors) == 1, (name, r.stderr)
    assert peak < MEMORY_KIB, f"{peak} KiB"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_every_command_on_a_damaged_run_is_one_line_and_never_hangs(hostile, name):
    """Each command that reads the damaged file says so in one line; one that does not read it
    (`logs` reads no events, only `status` and `watch` read metrics) works as for any run."""
    env, project = hostile
    said = DAMAGED[name][1].split(" is ")[0].split(" (")[0]
    reads = {"status": "all", "watch": "all", "cancel": "manifest events", "logs": "manifest",
             "logs -f": "manifest events", "submit": "manifest events"}
    for args in (["status", name], ["watch", name, "--once"], ["cancel", name], ["logs", name], ["logs", name, "-f"],
                 ["submit", "tiny_cpu", "--run-name", name, "--force", "data.tokenize_in_job=true"]):
        r, peak = slipway(*args, env=env, cwd=project)
        command = " ".join(a for a in args if a == "-f" or not a.startswith(("-", name, "tiny", "data")))
        lines = r.stderr.splitlines()
        damaged = "events" if "events" in name else "metrics" if "metrics" in name else "manifest"
        if reads[command] == "all" or damaged in reads[command]:
            assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("slipway: error: "), (args, r.stderr)
            assert said.split()[0] in lines[0], (args, lines[0])
        else:
            assert r.returncode == 0, (args, r.stderr)
        assert peak < MEMORY_KIB, (args, f"{peak} KiB")


@pytest.mark.slow
def test_huge_and_special_side_files_leave_a_run_readable(hostile):
    env, project = hostile
    for args in (["status", "huge-events"], ["status", "sparse-events"], ["watch", "huge-events", "--once"],
                 ["status", "fifo-side-files"], ["watch", "fifo-side-files", "--once"], ["logs", "huge-events"]):
        r, peak = slipway(*args, env=env, cwd=project)
        assert r.returncode == 0, (args, r.stderr)
        assert peak < MEMORY_KIB, (args, f"{peak} KiB")
    r, _ = slipway("status", "fifo-side-files", env=env, cwd=project)
    assert "hung (attempt 1 of job 14)" in r.stdout and "COMPLETED" in r.stdout, r.stdout
    for name in (".code", "..", "../runs/ok1", "ok1/"):  # the code store, or a path, is no run
        r, _ = slipway("status", name, env=env, cwd=project)
        assert r.returncode == 2 and r.stderr.startswith("slipway: error: RUN: "), (name, r.stderr)


# ---------------------------------------------------------------- a teammate's closed runs


@pytest.fixture
def shared_project(teammate) -> tuple[object, dict, Path]:
    """Root's runs in a project a second user reads: a run directory closed to it (0700), one
    whose events.log is closed (0600), a closed code store, and an open run."""
    project = teammate.shared / "proj"
    shutil.copytree(Path(__file__).resolve().parent.parent / "configs", project / "configs")
    root = project / "runs"
    done_run(root, "open")
    done_run(root, "closed").chmod(0o700)
    (done_run(root, "closed-events") / "events.log").chmod(0o600)
    (root / ".code" / "c").mkdir(parents=True)
    (root / ".code").chmod(0o700)
    root.chmod(0o1777)  # a team's runs directory: each may add runs
    slurm = StandInSlurm(teammate.shared / "slurm")
    (slurm.root / "calls").chmod(0o666)
    env = teammate.env(PATH=f"{slurm.bin}:{os.environ['PATH']}", STANDIN=str(slurm.root),
                       SLIPWAY_PROJECT=str(project))
    return teammate, env, project


def test_a_teammates_closed_run_is_one_row_and_every_other_run_is_listed(shared_project):
    mate, env, project = shared_project
    r = mate.slipway("status", env=env, cwd=project)
    assert r.returncode == 0 and r.stderr == "", r.stderr  # a teammate's run is no damage to fix
    shown = rows(r.stdout)
    assert sorted(shown) == ["closed", "closed-events", "open"] and shown["open"][2] == "COMPLETED", r.stdout
    assert shown["closed"][2] == "UNREADABLE" and "not readable by you (owned by root, mode 0700)" in shown["closed"][-1]
    assert shown["closed-events"][2] == "UNREADABLE" and \
        "events.log not readable by you (owned by root, mode 0600)" in shown["closed-events"][-1], r.stdout


@pytest.mark.slow
def test_every_command_on_a_teammates_closed_run_is_one_line(shared_project):
    mate, env, project = shared_project
    root = project / "runs"
    before = sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*"))
    for args in (["status", "closed"], ["watch", "closed", "--once"], ["cancel", "closed"], ["logs", "closed"],
                 ["submit", "tiny_cpu", "--run-name", "closed", "data.tokenize_in_job=true"],
                 ["status", "closed-events"], ["watch", "closed-events", "--once"], ["cancel", "closed-events"]):
        r = mate.slipway(*args, env=env, cwd=project, timeout=HANG)
        lines = r.stderr.splitlines()
        assert r.returncode == 2 and len(lines) == 1, (args, r.stderr)
        assert "not readable by you (owned by root, mode 0700)" in lines[0] or \
            "Permission denied (" in lines[0] and "owned by root, mode 0" in lines[0], (args, r.stderr)
    # Nothing of the runs was written over; a refused submission leaves only its lock file.
    after = sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*") if not p.name.endswith(".lock"))
    assert after == [entry for entry in before if not entry[0].endswith(".lock")]


# ---------------------------------------------------------------- the terminal

# What a job, a file or Slurm could send to a terminal: retitle it (OSC), clear it, move the
# cursor, ring, reorder what follows (bidi), end a line early.
HOSTILE = "\x1b]0;PWNED\x07\x1b[2J\x1b[H\x9b31m\u202egnp.exe\u2066\r\x08\x0b"


def _raw(text: str) -> list[str]:
    """The control characters in `text` that are not line ends."""
    return sorted({c for c in text if (c < " " and c != "\n") or "\x7f" <= c <= "\x9f" or c in "\u202e\u2066"})


@pytest.fixture
def hostile_text(project, tmp_path):
    """A run whose every file, and Slurm, say HOSTILE: events, the manifest's image, metrics, a
    hang dump's host, a heartbeat's node name; and a run directory named with it."""
    slurm = StandInSlurm(tmp_path / "slurm")
    root = project / "runs"
    run = make_run(root, "evil", [Launch(job_id="21", submitted=T0, steps=50)],
                   [START, f"retry 1/2 (hang{HOSTILE}): requeueing", START, f"preflight ok {HOSTILE}",
                    f"hang: {HOSTILE} stack dumps in hangs/21r1-*.txt", f"other {HOSTILE}"])
    record = json.loads((run / "manifest.json").read_text())
    record["image"] = {"image": f"img{HOSTILE}", "path": "", "source": "none"}
    (run / "manifest.json").write_text(json.dumps(record))
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": f"1{HOSTILE}", "loss": 2.0,
                                                   "eta_s": f"{HOSTILE}"}) + "\n")
    (run / "hangs").mkdir()
    (run / "hangs" / "21r1-node1-0.txt").write_text(f"slipway-hang rank=0 host=n{HOSTILE} step=3 idle=9 limit=5 "
                                                  "answered=late\n")
    (run / "heartbeats").mkdir()
    (run / "heartbeats" / f"node{HOSTILE.replace('/', '')}").write_text("")
    slurm.job("21", "RUNNING", reason=f"Why{HOSTILE}")
    done_run(root, f"named{HOSTILE}", "22")
    return slurm.env(), project


@pytest.mark.slow
def test_nothing_a_file_a_job_or_slurm_says_reaches_the_terminal_raw(hostile_text):
    env, project = hostile_text
    for args in (["status"], ["status", "evil"], ["watch", "evil", "--once"], ["status", f"named{HOSTILE}"],
                 ["status", f"gone{HOSTILE}"], ["logs", "evil", "--job", f"1{HOSTILE}"]):
        r, _ = slipway(*args, env=env, cwd=project)
        assert not _raw(r.stdout) and not _raw(r.stderr), (args, _raw(r.stdout), _raw(r.stderr), r.stdout, r.stderr)
        assert "\\x1b]0;PWNED\\x07" in r.stdout + r.stderr or args[0] == "logs", (args, r.stdout, r.stderr)
    r, _ = slipway("status", "evil", env=env, cwd=project)
    assert "\\u202egnp.exe" in r.stdout and "rank 0 on n\\x1b]0;PWNED" in r.stdout, r.stdout


def _tmux(server: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", server, *args], capture_output=True, text=True, timeout=30).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (Debian package tmux)")
def test_a_terminal_keeps_its_title_and_its_screen(hostile_text):
    """In a real terminal (tmux): the run's text neither retitles the terminal nor clears it."""
    env, project = hostile_text
    server = f"slipway-company-{os.getpid()}"
    shell_env = [f"{k}={v}" for k, v in env.items() if k in ("PATH", "STANDIN", "SLIPWAY_PROJECT")]
    _tmux(server, "new-session", "-d", "-s", "t", "-x", "200", "-y", "100", *sum((["-e", e] for e in shell_env), []))
    try:
        _tmux(server, "set-option", "-t", "t", "allow-rename", "on")
        _tmux(server, "select-pane", "-t", "t", "-T", "before")
        marker = "MARKER-BEFORE-SLIPWAY"
        command = f"echo {marker}; cd {json.dumps(str(project))} && {PY} -m jobs status evil; " \
                  f"{PY} -m jobs watch evil --once; echo DONE-$((6*7))"
        _tmux(server, "send-keys", "-t", "t", "-l", command)
        _tmux(server, "send-keys", "-t", "t", "Enter")
        deadline = time.monotonic() + HANG
        while "DONE-42" not in (screen := _tmux(server, "capture-pane", "-p", "-J", "-t", "t")):
            assert time.monotonic() < deadline, screen
            time.sleep(0.5)
        assert f"\n{marker}\n" in screen, screen  # the screen was not cleared: what came before is still there
        assert _tmux(server, "display-message", "-p", "-t", "t", "#{pane_title}").strip() == "before"
        assert "PWNED" in screen and "\\x1b]0;PWNED" in screen, screen  # shown, escaped
    finally:
        subprocess.run(["tmux", "-L", server, "kill-server"], capture_output=True)
