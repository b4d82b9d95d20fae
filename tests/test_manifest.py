"""The run's manifest (jobs/runs/manifest.py): one typed model read and written in one place.

A manifest of the format before `schema` reads the same; what a newer slipway wrote is kept
through a rewrite; and every damaged manifest (empty, cut short, not JSON, wrong types, a list,
too large) is one line naming the file and what to do, exit 2, for that run only, through every
command that reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import runs
from jobs.runs import manifest as manifests
from jobs.runs.manifest import SCHEMA, Launch, ManifestError
from common.rundir import RunDir
from slurm_standin import StandInSlurm

PY = sys.executable
T0 = "2026-01-01T12:00:00+00:00"
IMAGE = {"reference": "", "image": "/img/slipway-0123456789ab.sqsh", "source": "build",
         "path": "/img/slipway-0123456789ab.sqsh", "size": 4096, "mtime": T0, "build_hash": "0123456789ab" * 5,
         "tag": "localhost/slipway:0123456789ab"}
CODE = {"hash": "f" * 64, "dir": "/runs/.code/ffffffffffffffff", "files": 40, "bytes": 90000,
        "source": "/project/trainer", "commit": "c0ffee", "dirty": False}
# What slipway wrote before the manifest had a schema (jobs/runs/__init__.py, jobs/interactive.py).
UNVERSIONED = {
    "run": "r", "created": T0, "project_dir": "/project", "git": {"commit": "c0ffee", "dirty": False},
    "image": IMAGE, "runtime": "pyxis", "launcher": "torchrun", "config_sha256": "a" * 64,
    "submissions": [
        {"job_id": "40", "kind": "prepare", "submitted": T0, "git": {"commit": "c0ffee", "dirty": False},
         "image": IMAGE, "code": None, "script_sha256": "b" * 64},
        {"job_id": "41", "kind": "train", "submitted": T0, "git": {"commit": "c0ffee", "dirty": False},
         "image": IMAGE, "code": CODE, "script_sha256": "c" * 64, "after": "40"},
        {"job_id": None, "local": True, "started": T0, "pid": 12, "trainer_pid": 13, "host": "h",
         "log": "logs/local-1.out", "git": {}, "code": CODE, "ended": T0, "exit": 143, "signal": "SIGTERM",
         "trainer_exit": -15},
    ],
    "code": CODE,
}


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_the_format_before_the_schema_reads_and_a_rewrite_keeps_every_key(tmp_path):
    path = write(tmp_path / "r" / "manifest.json", UNVERSIONED)
    m = manifests.read(path)
    assert (m.schema, m.run, m.image.build_hash, m.code.hash, m.runtime) == (SCHEMA, "r", IMAGE["build_hash"],
                                                                               CODE["hash"], "pyxis")
    prep, train, here = m.submissions
    assert (prep.kind, prep.id, train.after, train.code.dir, here.local, here.id) == \
        ("prepare", "40", "40", CODE["dir"], True, "local")
    assert (here.recorded_exit, here.signal_number, here.trainer_exit) == (143, 15, -15)
    manifests.write(path, m)
    again = json.loads(path.read_text())
    assert again.pop("schema") == SCHEMA
    # Each launch keeps its values; an entry drops only what is empty, and says its kind.
    def meant(entry: dict) -> dict:
        return {k: v for k, v in entry.items() if v not in (None, "", {}) and (k, v) != ("kind", "train")}

    for old, new in zip(UNVERSIONED["submissions"], again["submissions"]):
        assert meant(old) == meant(new) and new["kind"] == old.get("kind", "train")
    # Every key it had, as it was; a field added since, at its empty default, besides.
    assert {k: v for k, v in again.items() if k != "submissions" and (k in UNVERSIONED or v not in ({}, None, ""))} \
        == {k: v for k, v in UNVERSIONED.items() if k != "submissions"}


def test_a_key_this_slipway_does_not_know_survives_a_rewrite(tmp_path):
    """A key beside the ones of this format (a hand edit, a tool's note) is kept as it was."""
    noted = json.loads(json.dumps(UNVERSIONED))
    noted.update(schema=SCHEMA, note=[1, {"x": 2}])
    noted["submissions"][1]["reviewed_by"] = "ana"
    path = write(tmp_path / "r" / "manifest.json", noted)
    run = runs.Run(RunDir(path.parent, tmp_path))
    runs.update_manifest(run, lambda m: m.submissions.append(Launch(job_id="42", submitted=T0)))
    after = json.loads(path.read_text())
    assert after["note"] == [1, {"x": 2}] and after["submissions"][1]["reviewed_by"] == "ana"
    assert [s["job_id"] for s in after["submissions"]] == ["40", "41", None, "42"]
    assert run.launches()[-1].id == "42" and run.manifest().code.hash == CODE["hash"]


def test_a_manifest_of_a_newer_format_is_refused_not_rewritten(tmp_path):
    """What a newer slipway wrote may mean what this one cannot tell: it is refused in one line for
    that run, and never written over."""
    newer = {**UNVERSIONED, "schema": SCHEMA + 1, "future": {"x": 1}}
    path = write(tmp_path / "r" / "manifest.json", newer)
    before = path.read_bytes()
    with pytest.raises(ManifestError) as caught:
        manifests.read(path)
    line = str(caught.value)
    assert line.startswith(f"{path}: written by a newer slipway (manifest format {SCHEMA + 1}; this one reads "
                           f"format {SCHEMA} and older)") and "upgrade" in line and "damaged" not in line, line
    run = runs.Run(RunDir(path.parent, tmp_path))
    with pytest.raises(ManifestError):
        runs.update_manifest(run, lambda m: m.submissions.append(Launch(job_id="42", submitted=T0)))
    assert path.read_bytes() == before


TRUNCATED = json.dumps(UNVERSIONED, indent=2)[:700]
DAMAGE = {
    "empty": ("", "empty"),
    "blank": ("  \n", "empty"),
    "truncated": (TRUNCATED, "not JSON"),
    "not JSON": ("run = r\n", "not JSON"),
    "a list": ("[]", "a list, not an object"),
    "null": ("null", "null, not an object"),
    "a number": ("3", "an integer, not an object"),
    "submissions not a list": ({**UNVERSIONED, "submissions": {"0": {}}}, "submissions: expected a list"),
    "an entry not an object": ({**UNVERSIONED, "submissions": ["41"]}, "submissions[0]: expected a mapping of keys"),
    "a pid as text": ({**UNVERSIONED, "submissions": [{"job_id": None, "local": True, "pid": "12"}]},
                      "submissions[0].pid: expected an integer"),
    "a job id that is none": ({**UNVERSIONED, "submissions": [{"job_id": "../../x"}]}, "no Slurm job id"),
    "an entry without a job id": ({**UNVERSIONED, "submissions": [{"kind": "train"}]}, "no Slurm job id"),
    "a log outside the run": ({**UNVERSIONED, "submissions": [{"local": True, "log": "../../etc/passwd"}]},
                              "not a path inside the run directory"),
    "a secret where the kind belongs": ({**UNVERSIONED, "submissions": [{"job_id": "4", "kind": "HF_TOKEN=hf_x1"}]},
                                        "kind: 'HF_TOKEN=<hidden>' is neither"),
    "an image as text": ({**UNVERSIONED, "image": "/img/x.sqsh"}, "image: expected a mapping of keys"),
    "an image without its source": ({**UNVERSIONED, "image": {"image": "/img/x.sqsh"}}, "image.source: '' is not one of build, file"),
    "a code hash as a number": ({**UNVERSIONED, "code": {**CODE, "hash": 5}}, "code.hash: expected a string"),
    "a size as a boolean": ({**UNVERSIONED, "image": {**IMAGE, "size": True}}, "image.size: expected int or null, got True"),
    "created as a number": ({**UNVERSIONED, "created": 1767268800}, "created: expected a string"),
    "schema as text": ({**UNVERSIONED, "schema": "1"}, "schema: expected an integer"),
    "not UTF-8": (b'{"run": "\xff"}', "not UTF-8 text"),
    "nested too deeply": ("[" * 200000 + "]" * 200000, "nested too deeply"),
}


@pytest.mark.parametrize("data,why", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_manifest_is_one_line_naming_the_file_and_what_to_do(tmp_path, data, why):
    path = tmp_path / "r" / "manifest.json"
    path.parent.mkdir()
    path.write_bytes(data if isinstance(data, bytes) else (data if isinstance(data, str) else json.dumps(data)).encode())
    with pytest.raises(ManifestError) as caught:
        manifests.read(path)
    line = str(caught.value)
    assert line.startswith(f"{path}: damaged (") and why in line and "\n" not in line, line
    assert "restore it from a backup, or move the run directory aside" in line and "squeue --name r,r-prepare" in line


def test_a_huge_or_missing_manifest_is_damaged_too(tmp_path, monkeypatch):
    path = write(tmp_path / "r" / "manifest.json", UNVERSIONED)
    monkeypatch.setattr(manifests, "MAX_BYTES", 1000)
    with pytest.raises(ManifestError, match="larger than"):
        manifests.read(path)
    with pytest.raises(ManifestError, match=r"damaged \(missing\)"):
        manifests.read(tmp_path / "gone" / "manifest.json")


def test_a_damaged_manifest_is_never_written_over(tmp_path):
    path = write(tmp_path / "r" / "manifest.json", TRUNCATED)
    run = runs.Run(RunDir(path.parent, tmp_path))
    with pytest.raises(ManifestError):
        runs.update_manifest(run, lambda m: m.submissions.append(Launch(job_id="42")))
    assert path.read_text() == TRUNCATED


# ------------------------------------------------------------------ through every command


def slipway(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=180,
                          env={**env, "COLUMNS": "400"})


def one_line(r: subprocess.CompletedProcess, path: Path, *words: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert lines[0].startswith(f"slipway: error: {path}: damaged ("), lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def damaged(project, tmp_path):
    """Runs `good` and `bad` submitted through the CLI to stand-in Slurm (their jobs ended), and
    `bad`'s manifest then cut short."""
    slurm = StandInSlurm(tmp_path / "slurm")
    env = slurm.env()
    for name in ("good", "bad"):
        r = slipway("submit", "tiny_cpu", "--run-name", name, env=env)
        assert r.returncode == 0, r.stderr
    for job in ("1001", "1002"):
        slurm.job(job, "COMPLETED")
    path = project / "runs" / "bad" / "manifest.json"
    path.write_text(path.read_text()[:300])
    return slurm, env, path


@pytest.mark.slow
def test_every_command_that_reads_a_damaged_manifest_says_so_for_that_run_only(project, damaged):
    slurm, env, path = damaged
    before = path.read_text()
    r = slipway("status", env=env)
    one_line(r, path)
    rows = {cells[0]: line for line in r.stdout.splitlines() if (cells := line.replace("│", " ").split())}
    assert "COMPLETED" in rows["good"] and "DAMAGED" in rows["bad"] and "manifest.json: not JSON" in rows["bad"]
    assert slipway("status", "good", env=env).returncode == 0
    for args in (["status", "bad"], ["logs", "bad"], ["logs", "bad", "-f"], ["watch", "bad", "--once"],
                 ["doctor", "--run", "bad"], ["doctor", "bad"]):
        one_line(slipway(*args, env=env), path)
    one_line(slipway("cancel", "bad", env=env), path, "cannot tell which jobs of the run to cancel",
             "squeue --name bad,bad-prepare")
    slurm.reset_calls()
    one_line(slipway("submit", "tiny_cpu", "--run-name", "bad", env=env), path)
    assert slurm.calls("sbatch") == [] and path.read_text() == before  # refused before anything was written
    assert slipway("submit", "tiny_cpu", "--run-name", "good", env=env).returncode == 0


@pytest.mark.slow
def test_local_refuses_a_run_whose_manifest_is_damaged(project, damaged):
    _, env, path = damaged
    one_line(slipway("local", "tiny_cpu", "--run-name", "bad", env=env), path)


def test_the_code_store_keeps_everything_while_a_manifest_is_damaged(project, damaged):
    """What a damaged manifest names is unknown: a launch prunes nothing from the store then."""
    _, env, path = damaged
    store = project / "runs" / ".code"
    orphan = store / ("0" * 16)
    orphan.mkdir()
    (orphan / "x.py").write_text("")
    old = time.time() - 3 * 86400
    os.utime(orphan, (old, old))
    stamp = project / "runs" / ".code.pruned"  # the store is pruned at most once an hour: an hour passed
    os.utime(stamp, (old, old))
    assert slipway("submit", "tiny_cpu", "--run-name", "third", env=env).returncode == 0
    assert orphan.exists() and stamp.stat().st_mtime == old  # not pruned: due at the next launch
    path.parent.rename(project / "runs-aside")  # the damaged run moved aside: the next launch prunes
    assert slipway("submit", "tiny_cpu", "--run-name", "fourth", env=env).returncode == 0
    assert not orphan.exists() and stamp.stat().st_mtime > old
    orphan.mkdir()
    os.utime(orphan, (old, old))
    assert slipway("submit", "tiny_cpu", "--run-name", "fifth", env=env).returncode == 0
    assert orphan.exists()  # pruned within the hour: not again
