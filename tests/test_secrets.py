"""Secrets never land anywhere (docs/secrets.md).

Through the command line as a user types it, on every runtime: variables named in
`container.env_from_host` reach the job (the batch script's sruns, pyxis' --container-env,
the Container Engine's `${VAR}`), `slipway local` and `slipway shell`, while their values
appear in no file slipway writes, in no output it prints, and in no line `launch.debug`'s
`set -x` traces. A secret given a value in a config, by its name (every spelling) or by its
shape, in any field, is refused in one line that never shows it, through every command and
under every runtime; names and values users set every day are not. The user's own text
(launch.pre_launch, a hand-written EDF) is warned about by line. Run directories are never
world-writable, whatever the umask. The policy's own lists: test_secret_policy.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shlex
import stat
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from plumbum import local

from conftest import SRUN_PASSING_PREFLIGHT, squeue_answering, tree
from jobs.cli import main
from jobs.config import Config
from common.schema import config_fields
from common.secrets import IDENTIFIER
from test_secret_policy import (BARE, ORDINARY_NAMES, ORDINARY_VALUES, SECRET_NAMES, SHAPES, SPELLINGS, shaped,
                                spellings)

PY = sys.executable
# Unique values: any file or output holding one of them has leaked it.
MARKERS = {"HF_TOKEN": "hf_" + secrets.token_hex(12), "WANDB_API_KEY": "wb" + secrets.token_hex(16)}
FROM_HOST = "container.env_from_host=[HF_TOKEN, WANDB_API_KEY]"
RUNTIMES = ["edf", "pyxis", "none"]


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/bash\n" + body)
    (bin_dir / name).chmod(0o755)


# What a stand-in saw, written without a value: `NAME set` for each variable it was handed.
SAW = ('echo "HF_TOKEN ${HF_TOKEN:+set}"; echo "WANDB_API_KEY ${WANDB_API_KEY:+set}"; '
       'printf "arg %s\\n" "$@"')


@pytest.fixture
def host(project: Path, tmp_path: Path, monkeypatch):
    """The submitting shell: the two secrets exported, stand-ins for Slurm's commands first on
    PATH (plumbum keeps its own copy of the environment, so both are set)."""
    bin_dir = tmp_path / "fake-slurm"
    seen = tmp_path / "seen"
    seen.mkdir()
    stand_in(bin_dir, "sbatch", f'{{ {SAW}; }} > {shlex.quote(str(seen))}/sbatch\necho "$((RANDOM + 100))"\n')
    stand_in(bin_dir, "scontrol", 'case "$1 $2" in "ping "*) echo "Slurmctld(primary) at n1 is UP" ;;\n'
                                  '  *) echo n1 ;; esac\n')
    stand_in(bin_dir, "squeue", squeue_answering("COMPLETED"))
    # The shell's srun: what it was handed, and the modes of the EDF it was pointed at.
    stand_in(bin_dir, "srun", "{ " + SAW + "\n"
                              'for a in "$@"; do case "$a" in --environment=*) f=${a#--environment=}\n'
                              '  stat -c "edf %a" "$f"; stat -c "dir %a" "${f%/*}" ;; esac; done; } '
                              f'> {shlex.quote(str(seen))}/srun\n')
    values = {**MARKERS, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SBATCH_EXPORT", raising=False)
    umask = os.umask(0o022)
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    with local.env(**values):
        yield seen
    os.umask(umask)


def slipway(capfd, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capfd.readouterr()
    return rc, out, err


def runtime_args(project: Path, runtime: str) -> list[str]:
    image = [f"container.image={project / 'img.sqsh'}"] if runtime != "none" else []
    return [f"container.runtime={runtime}", *image, FROM_HOST]


def leaks(*texts: str, under: Path | None = None) -> list[str]:
    """Where a marker value appears: in the given texts, or in any file under `under`."""
    found = [f"output {i}" for i, text in enumerate(texts) for v in MARKERS.values() if v in text]
    if under is not None:
        for path in under.rglob("*"):
            if path.is_file() and any(v.encode() in path.read_bytes() for v in MARKERS.values()):
                found.append(str(path))
    return found


# ------------------------------------------------------------------ every runtime, every command


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_secrets_reach_the_job_and_land_nowhere(project, host, capfd, runtime):
    args = ["tiny_cpu", *runtime_args(project, runtime), "launch.debug=true", "--run-name", "sec"]
    outputs = []
    for command in (["submit", "--dry-run"], ["submit"], ["doctor"], ["prepare", "--as-job"],
                    ["shell", "--dry-run"], *([["edf"]] if runtime != "none" else [])):
        rc, out, err = slipway(capfd, *command, *args)
        outputs += [out, err]
        assert rc == 0 or command == ["doctor"], (command, out, err)  # no controller answers the doctor
        assert "export HF_TOKEN" not in out + err and "export WANDB_API_KEY" not in out + err
    run_dir = project / "runs" / "sec"
    assert (run_dir / "manifest.json").is_file()
    # sbatch was handed both (its default --export=ALL takes them into the job)
    assert "HF_TOKEN set" in (host / "sbatch").read_text() and "WANDB_API_KEY set" in (host / "sbatch").read_text()
    script = (run_dir / "job.sbatch").read_text()
    assert "set -x" in script
    if runtime == "edf":
        env_toml = (run_dir / "env.toml").read_text()
        assert 'HF_TOKEN = "${HF_TOKEN}"' in env_toml and 'WANDB_API_KEY = "${WANDB_API_KEY}"' in env_toml
    if runtime == "pyxis":
        # the training step's line: the code snapshot's variables are set for it alone, before srun
        srun = next(line for line in script.splitlines() if "srun --kill-on-bad-exit=1 --wait=" in line)
        flag = next(w for w in shlex.split(srun.rstrip("\\")) if w.startswith("--container-env="))
        assert {"HF_TOKEN", "WANDB_API_KEY"} <= set(flag.split("=", 1)[1].split(","))
        assert "HF_TOKEN=" not in script and "WANDB_API_KEY=" not in script  # named, never assigned
    assert not leaks(*outputs, under=project)

    # The batch script itself, traced (launch.debug): its sruns get both, its trace shows neither.
    trace = run_batch_script(run_dir, host.parent / "job-bin")
    srun_saw = (run_dir / "srun-saw").read_text()
    assert "HF_TOKEN set" in srun_saw and "WANDB_API_KEY set" in srun_saw, srun_saw
    assert "+ " in trace and not leaks(trace, srun_saw, under=project)


def run_batch_script(run_dir: Path, bin_dir: Path, secrets_env: dict[str, str] = MARKERS, saw: str = SAW) -> str:
    """job.sbatch under bash with stand-in srun/scontrol and the secrets in its environment, as
    sbatch starts it; its output and set -x trace. The srun stand-in appends `saw`'s output to
    $RUN_DIR/srun-saw."""
    stand_in(bin_dir, "scontrol", "echo n1\n")
    stand_in(bin_dir, "srun", SRUN_PASSING_PREFLIGHT + f'{{ {saw}; }} >> "$RUN_DIR/srun-saw"\n')
    log = run_dir.parent.parent.parent / "job-trace.out"  # outside the project: it is read, then scanned
    with log.open("w") as out:
        r = subprocess.run(["bash", str(run_dir / "job.sbatch")], stdout=out, stderr=subprocess.STDOUT, timeout=120,
                           env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(run_dir), "SLURM_NNODES": "1",
                                "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "RUN_DIR": str(run_dir),
                                **secrets_env})
    trace = log.read_text()
    assert r.returncode == 0, trace
    return trace


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_shell_hands_secrets_on_and_keeps_no_file(project, host, capfd, runtime):
    args = ["tiny_cpu", *runtime_args(project, runtime), "launch.debug=true"]
    rc, out, err = slipway(capfd, "shell", *args, "--dry-run")
    assert rc == 0, err
    outputs = [out, err]
    if runtime == "edf":
        assert 'HF_TOKEN = "${HF_TOKEN}"' in out  # the EDF, as it would be written
    if runtime == "pyxis":
        assert "--container-env=SLIPWAY_CODE,PYTHONPATH,PYTHONSAFEPATH,HF_TOKEN,WANDB_API_KEY" in out
    assert not (project / "runs").exists()  # a dry run writes nothing
    rc, out, err = slipway(capfd, "shell", *args, "--command", "true")
    assert rc == 0, err
    outputs += [out, err]
    seen = (host / "srun").read_text()
    assert "HF_TOKEN set" in seen and "WANDB_API_KEY set" in seen, seen
    assert "arg true" in seen and "arg --pty" not in seen
    if runtime == "edf":
        # private while srun runs, and gone once the shell has ended
        assert "edf 600" in seen and "dir 700" in seen, seen
        assert list((project / "runs" / ".shell").iterdir()) == []
    if runtime == "pyxis":
        assert "arg --container-env=SLIPWAY_CODE,PYTHONPATH,PYTHONSAFEPATH,HF_TOKEN,WANDB_API_KEY" in seen
    assert not leaks(*outputs, seen, under=project)


def test_local_takes_them_from_its_own_environment(project, host, capfd):
    code = "import os; print('got', sorted(k for k in ('HF_TOKEN', 'WANDB_API_KEY') if os.environ.get(k)))"
    rc, out, err = slipway(capfd, "local", "tiny_cpu", FROM_HOST, "launch.procs_per_node=1", "--run-name", "loc",
                           f"launch.command=[{PY}, -c, {json.dumps(code)}]")
    assert rc == 0, (out, err)
    assert "got ['HF_TOKEN', 'WANDB_API_KEY']" in out
    assert not leaks(out, err, under=project)


# ------------------------------------------------------------------ a variable not exported


@pytest.mark.parametrize("command", [["submit"], pytest.param(["local"], marks=pytest.mark.slow), ["shell", "--command", "true"]])
def test_an_unset_variable_is_refused_in_one_line(project, host, capfd, monkeypatch, command):
    monkeypatch.delenv("WANDB_API_KEY")
    before = tree(project)
    rc, out, err = slipway(capfd, command[0], "tiny_cpu", FROM_HOST, *command[1:])
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slipway: error: container.env_from_host:"), err
    assert "export WANDB_API_KEY=..." in lines[0] and "HF_TOKEN" not in lines[0]
    assert tree(project) == before


@pytest.mark.parametrize("command", [["submit", "--dry-run"], ["shell", "--dry-run"]])
def test_a_dry_run_says_it_as_a_note(project, host, capfd, monkeypatch, command):
    """Once: `submit --dry-run` among what would refuse the submission, `shell --dry-run` as a note."""
    monkeypatch.delenv("HF_TOKEN")
    rc, out, err = slipway(capfd, *command, "tiny_cpu", FROM_HOST)
    assert rc == (2 if command[0] == "submit" else 0), err  # a dry run that would be refused exits 2
    said = "  - " if command[0] == "submit" else "note:"
    before_files = (out + err).split("==> ")[0]  # a refused dry run says its verdict last again, after the files
    notes = [line for line in before_files.splitlines() if line.startswith(said) and "env_from_host" in line]
    assert len(notes) == 1 and "export HF_TOKEN=..." in notes[0], out + err


def test_an_export_that_drops_them_is_refused(project, host, capfd, monkeypatch):
    rc, _, err = slipway(capfd, "submit", "tiny_cpu", FROM_HOST, "slurm.extra=[--export=NONE]")
    assert rc == 2 and err.startswith("slipway: error: slurm.extra[0]:") and "--export=ALL" in err
    monkeypatch.setenv("SBATCH_EXPORT", "PATH,HF_TOKEN")
    rc, _, err = slipway(capfd, "submit", "tiny_cpu", FROM_HOST)
    assert rc == 2 and err.startswith("slipway: error: SBATCH_EXPORT:") and "WANDB_API_KEY" in err
    monkeypatch.setenv("SBATCH_EXPORT", "ALL")
    assert slipway(capfd, "submit", "tiny_cpu", FROM_HOST)[0] == 0


# ------------------------------------------------------------------ secrets given a value


@pytest.mark.parametrize("field, name", [
    ("container.env", "HF_TOKEN"), ("container.env", "hf_token"), ("container.env", "wandb_key"),
    ("container.env", "my_api_key"), ("container.env", "DB_PASSWD"), ("container.env", "Aws_Secret_Access_Key"),
    ("launch.env", "WANDB_API_KEY"), ("launch.env", "hf_token"), ("launch.env", "wandb_key"),
    ("launch.env", "my_api_key"), ("launch.env", "GIT_CREDENTIALS"),
    ("image.build_args", "HF_TOKEN"), ("image.build_args", "my_api_key"), ("image.build_args", "private_key"),
])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_secret_given_a_value_is_refused(project, host, capfd, field, name, runtime):
    before = tree(project)
    value = MARKERS["HF_TOKEN"]
    rc, out, err = slipway(capfd, "submit", "tiny_cpu", *runtime_args(project, runtime)[:-1],
                           f"{field}.{name}={value}")
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"slipway: error: {field}.{name}: looks like a secret"), err
    assert f"container.env_from_host: [{name}]" in lines[0] and f"export {name}=..." in lines[0]
    assert not leaks(out, err) and tree(project) == before


@pytest.mark.parametrize("override, field", [
    ("container.env.HF_TOKEN=${OTHER}", "container.env.HF_TOKEN"),  # only its own name passes through
    ("container.env.HEADER=Bearer ${HF_TOKEN}", "container.env.HEADER"),  # pyxis would trace the value
    ("launch.env.HEADER=Bearer ${WANDB_API_KEY}", "launch.env.HEADER"),
    ("launch.env.HF_TOKEN=${HF_TOKEN}", "launch.env.HF_TOKEN"),  # exported by the script's text
])
def test_values_that_would_expand_a_secret_into_the_script_are_refused(project, host, capfd, override, field):
    rc, _, err = slipway(capfd, "submit", "tiny_cpu", "container.runtime=pyxis",
                         f"container.image={project / 'img.sqsh'}", override)
    assert rc == 2 and err.startswith(f"slipway: error: {field}:") and "container.env_from_host: [" in err, err
    assert len(err.strip().splitlines()) == 1


def test_its_own_reference_is_a_pass_through_and_look_alikes_pass(project, host, capfd):
    """`HF_TOKEN: ${HF_TOKEN}` in container.env is what env_from_host writes into an EDF: allowed,
    and under pyxis named, never assigned. TOKENIZERS_PARALLELISM holds no secret."""
    rc, out, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", "container.runtime=pyxis",
                           f"container.image={project / 'img.sqsh'}", "container.env.HF_TOKEN=${HF_TOKEN}",
                           "container.env.TOKENIZERS_PARALLELISM=false", "launch.debug=true")
    assert rc == 0, err
    assert "--container-env=TOKENIZERS_PARALLELISM,SLIPWAY_CODE,PYTHONPATH,PYTHONSAFEPATH,HF_TOKEN" in out
    assert "HF_TOKEN=" not in out
    assert "TOKENIZERS_PARALLELISM=false" in out and not leaks(out, err)


@pytest.mark.parametrize("value, words", [
    ("[HF_TOKEN, HF_TOKEN]", "listed twice"), ("[1BAD]", "not a valid environment variable name"),
    ("[FOO-BAR]", "not a valid environment variable name"),
])
def test_env_from_host_names_are_checked(project, host, capfd, value, words):
    rc, _, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", f"container.env_from_host={value}")
    assert rc == 2 and err.startswith("slipway: error: container.env_from_host[") and words in err, err


def test_env_from_host_and_env_cannot_both_set_a_name(project, host, capfd):
    rc, _, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", "container.env_from_host=[FOO]",
                         "container.env.FOO=1")
    assert rc == 2 and "container.env_from_host[0]: FOO is also set in container.env" in err, err


# ------------------------------------------------------------------ permissions


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_run_directories_are_never_world_writable(project, host, capfd, umask):
    os.umask(umask)
    rc, _, err = slipway(capfd, "submit", "tiny_cpu", "--run-name", "perm")
    assert rc == 0, err
    run_dir = project / "runs" / "perm"
    for path in [run_dir, *run_dir.rglob("*"), project / "runs"]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert not mode & 0o002, (path, oct(mode))
    mode = stat.S_IMODE(run_dir.stat().st_mode)
    assert mode & 0o050 == 0o050, oct(mode)  # teammates read it, as the umask allows
    assert not list(run_dir.rglob(".*.tmp")) and not list(project.joinpath("runs").glob(".perm.*.tmp"))
    assert not stat.S_IMODE((project / "runs" / ".perm.lock").stat().st_mode) & 0o022  # the run's lock
    # a directory made world-writable before is fixed on the next submission
    os.chmod(run_dir, 0o777)
    assert slipway(capfd, "submit", "tiny_cpu", "--run-name", "perm")[0] == 0
    assert not stat.S_IMODE(run_dir.stat().st_mode) & 0o002


def test_a_base_environment_s_literal_is_replaced_or_refused_under_pyxis(project, host, capfd, tmp_path,
                                                                         monkeypatch):
    """Under pyxis a base EDF's [env] is resolved into the batch script: env_from_host replaces
    its entry of the same name; a secret-looking literal left there is refused like one in the config."""
    edf_dir = tmp_path / "edfs"
    edf_dir.mkdir()
    (edf_dir / "site.toml").write_text(f'[env]\nHF_TOKEN = "{MARKERS["HF_TOKEN"]}"\nFOO = "1"\n')
    monkeypatch.setenv("EDF_PATH", str(edf_dir))
    args = ["tiny_cpu", "container.runtime=pyxis", f"container.image={project / 'img.sqsh'}",
            "container.base_environment=[site]"]
    rc, out, err = slipway(capfd, "submit", "--dry-run", *args, FROM_HOST)
    assert rc == 0, err
    assert "--container-env=FOO,SLIPWAY_CODE,PYTHONPATH,PYTHONSAFEPATH,HF_TOKEN,WANDB_API_KEY" in out and not leaks(out, err)
    rc, out, err = slipway(capfd, "submit", "--dry-run", *args)
    assert rc == 2 and err.startswith("slipway: error: container.env.HF_TOKEN: looks like a secret"), err
    assert not leaks(out, err)


def test_an_export_with_a_secret_value_is_refused(project, host, capfd):
    before = tree(project)
    rc, out, err = slipway(capfd, "submit", "tiny_cpu", f"slurm.extra=[\"--export=ALL,HF_TOKEN={MARKERS['HF_TOKEN']}\"]")
    assert rc == 2 and err.startswith("slipway: error: slurm.extra[0]: looks like a secret (Hugging Face Token)"), err
    assert "container.env_from_host: [HF_TOKEN]" in err
    assert not leaks(out, err) and tree(project) == before
    rc, out, err = slipway(capfd, "submit", "tiny_cpu", "slurm.extra=[\"--export=ALL,AUTHORIZATION=abc123\"]")
    assert rc == 2 and err.startswith("slipway: error: slurm.extra[0]: looks like a secret (AUTHORIZATION=...)"), err
    assert "abc123" not in err and "container.env_from_host: [AUTHORIZATION]" in err and tree(project) == before
    # $SBATCH_EXPORT is the submitting environment's, checked at submission by the same policy
    os.environ["SBATCH_EXPORT"] = "ALL,AUTHORIZATION=abc123"
    try:
        rc, out, err = slipway(capfd, "submit", "tiny_cpu")
    finally:
        del os.environ["SBATCH_EXPORT"]
    assert rc == 2 and err.startswith("slipway: error: SBATCH_EXPORT: looks like a secret") and "abc123" not in err



# ------------------------------------------------------------------ the policy through every command

# What a user runs with a config: each reads it through the same edge, under every runtime.
COMMANDS = [["submit", "--dry-run"], ["submit"], ["doctor"], ["edf"], ["shell", "--dry-run"], ["local"],
            ["prepare", "--as-job"]]
EXAMPLES = int(os.environ.get("SLIPWAY_SECRET_EXAMPLES", "40"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def base_config(project: Path, runtime: str) -> dict:
    raw = yaml.safe_load((project / "configs" / "tiny_cpu.yaml").read_text())
    raw["container"] = {"runtime": runtime, **({"image": str(project / "img.sqsh")} if runtime != "none" else {})}
    return raw


def put(raw: dict, dotted: str, value) -> None:
    node = raw
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def refused_cleanly(project: Path, capfd, command: list[str], raw: dict, field: str, secret: str) -> str:
    """Run `command` on the config `raw` (written outside the project): refused in one line naming
    `field` and the pass-through form, `secret` nowhere, nothing written. The line."""
    path = project.parent / "configs-outside" / "secret.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    before = tree(project)
    rc, out, err = slipway(capfd, *command, str(path))
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (command, field, out, err)
    assert lines[0].startswith(f"slipway: error: {field}: "), (field, lines[0])
    assert "container.env_from_host: [" in lines[0], lines[0]
    assert secret not in out + err, (field, out, err)
    assert tree(project) == before, "a refused command wrote files"
    return lines[0]


def by_name(kind: str, spelled: str, value: str) -> tuple[str, object, str]:
    """(the field, what it is set to, the field path an error names) for a secret's name in `kind`."""
    key = spelled if "." in spelled else f"com.example.{spelled}"
    return {
        "container.env": ("container.env", {spelled: value}, f"container.env.{spelled}"),
        "launch.env": ("launch.env", {spelled: value}, f"launch.env.{spelled}"),
        "image.build_args": ("image.build_args", {spelled: value}, f"image.build_args.{spelled}"),
        "container.annotations": ("container.annotations", {key: value}, f"container.annotations.{key}"),
        "slurm.extra": ("slurm.extra", ["--exclusive", f"--export=ALL,{spelled}={value}"], "slurm.extra[1]"),
        "launch.command": ("launch.command", ["python3", "-m", "tool", f"--{spelled}", value], "launch.command[4]"),
        "data.dataset": ("data.dataset", f"https://data.example.org/x?{spelled}={value}", "data.dataset"),
    }[kind]


@PROPERTY
@given(name=st.sampled_from(SECRET_NAMES), how=st.sampled_from(SPELLINGS),
       kind=st.sampled_from(["container.env", "launch.env", "image.build_args", "container.annotations",
                             "slurm.extra", "launch.command", "data.dataset"]),
       runtime=st.sampled_from(RUNTIMES), command=st.sampled_from(COMMANDS))
def test_a_secret_by_name_is_refused_in_every_field(project, host, capfd, name, how, kind, runtime, command):
    value = "m" + secrets.token_hex(10)  # no token's shape: the name alone says it is a secret
    dotted, setting, field = by_name(kind, spellings(name)[how], value)
    raw = base_config(project, runtime)
    put(raw, dotted, setting)
    refused_cleanly(project, capfd, command, raw, field, value)


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, typing.Any, str]]:
    """(dotted field, type, what it holds: its secret policy's kind) for every field of the config tree."""
    out = []
    hints = typing.get_type_hints(cls)
    for name, f in config_fields(cls).items():
        tp, path = hints[name], f"{prefix}{name}"
        out += _leaves(tp, f"{path}.") if dataclasses.is_dataclass(tp) else [(path, tp, f.metadata.get("secrets", IDENTIFIER))]
    return out


# Every field, whatever its type: a value shaped like a secret is refused as it is read; a bare key
# (BARE: a random word, which only its randomness tells from a commit or a digest) where the field
# may hold a credential (its kind is no IDENTIFIER). The user's own shell lines are the one
# exception (warned about: see below).
FIELDS = [(f, tp, kind) for f, tp, kind in _leaves(Config) if f != "launch.pre_launch"]


def _judged(shape: str, kind: str) -> bool:
    return shape not in BARE or kind != IDENTIFIER


@PROPERTY
@given(leaf=st.sampled_from(FIELDS), shape=st.sampled_from(sorted(SHAPES)), runtime=st.sampled_from(RUNTIMES),
       command=st.sampled_from(COMMANDS))
def test_a_secret_by_shape_is_refused_in_every_field(project, host, capfd, leaf, shape, runtime, command):
    dotted, tp, kind = leaf
    assume(_judged(shape, kind))
    value, body = shaped(shape)
    origin = typing.get_origin(tp)
    if origin is list:
        setting, field = [value], f"{dotted}[0]"
    elif origin is dict:
        setting, field = {"SOME_NAME": value}, f"{dotted}.SOME_NAME"
    else:
        setting, field = value, dotted
    raw = base_config(project, runtime)
    put(raw, dotted, setting)
    refused_cleanly(project, capfd, command, raw, field, body)


@pytest.mark.slow
@settings(max_examples=max(3, EXAMPLES // 6), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(SECRET_NAMES), how=st.sampled_from(["upper", "lower", "camel", "pascal", "digit"]),
       shape=st.sampled_from(sorted(SHAPES)), runtime=st.sampled_from(RUNTIMES))
def test_any_secret_passed_by_name_reaches_the_job_and_lands_nowhere(project, host, capfd, name, how, shape, runtime):
    """Any name in any spelling, any value's shape, under every runtime: through the commands, the
    files they write and the batch script's set -x trace, the value is never seen."""
    spelled = spellings(name)[how]
    value, body = shaped(shape)
    run = f"n{secrets.token_hex(4)}"
    args = ["tiny_cpu", *runtime_args(project, runtime)[:-1], f"container.env_from_host=[{spelled}]",
            "launch.debug=true", "--run-name", run]
    outputs = []
    os.environ[spelled] = value
    try:
        with local.env(**{spelled: value}):
            for command in (["submit", "--dry-run"], ["submit"], ["prepare", "--as-job"], ["shell", "--dry-run"],
                            *([["edf"]] if runtime != "none" else [])):
                rc, out, err = slipway(capfd, *command, *args)
                assert rc == 0, (command, err)
                outputs += [out, err]
            # what reads the run back: its status, its logs, a frame of watch
            for command in (["status"], ["status", run], ["logs", run], ["watch", run, "--once"]):
                outputs += slipway(capfd, *command)[1:]
    finally:
        del os.environ[spelled]
    run_dir = project / "runs" / run
    trace = run_batch_script(run_dir, host.parent / "job-bin", {spelled: value},
                             saw=f'echo "{spelled} ${{{spelled}:+set}}"')
    assert f"{spelled} set" in (run_dir / "srun-saw").read_text()  # the job's sruns have it
    seen = [text for text in (*outputs, trace) if body in text]
    files = [p for p in project.rglob("*") if p.is_file() and body.encode() in p.read_bytes()]
    assert not seen and not files, (spelled, shape, runtime, files)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_names_and_values_users_set_every_day_pass(project, host, capfd, runtime):
    values = {f"VALUE_{i}": v for i, v in enumerate(ORDINARY_VALUES) if "${HF_TOKEN}" not in v}
    names = {name: "1" for name in ORDINARY_NAMES}
    args = ["tiny_cpu", *runtime_args(project, runtime)[:-1], "--run-name", "everyday"]
    raw = base_config(project, runtime)
    put(raw, "container.env", names)
    put(raw, "launch.env", {**names, **values})
    put(raw, "image.build_args", {**names, **{k: v for k, v in values.items() if v}})
    put(raw, "container.annotations", {**{f"com.example.{n.lower()}": "true" for n in names if "PWD" not in n},
                                       **{f"com.example.{k.lower()}": v for k, v in values.items()}})
    put(raw, "slurm.extra", ["--exclusive", "--export=ALL,HF_TOKEN,WANDB_API_KEY"])
    put(raw, "data.dataset", "https://user@data.example.org/wikitext")
    path = project / "configs" / "everyday.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    rc, out, err = slipway(capfd, "submit", "--dry-run", "everyday", *args[1:])
    assert rc == 2 and "\n  - data: the token cache is not prepared" in out, err  # refused for its data alone
    assert "warning" not in err, err
    missing = [n for n in ORDINARY_NAMES if f"export {n}=" not in out]  # launch.env, exported by the script
    assert not missing, missing


def test_the_same_through_a_real_process(project, host):
    """`python -m jobs` as a user runs it: the refusal, the warning and the masked dry run come
    through the real error edge and streams."""
    value, body = shaped("openai")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, cwd=project, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})

    before = tree(project)
    r = run("submit", "tiny_cpu", f"container.env.OPENAI_API_KEY={value}")
    assert r.returncode == 2 and r.stderr.startswith("slipway: error: container.env.OPENAI_API_KEY: looks like a "
                                                     "secret (its name ends in KEY)"), r.stderr
    r2 = run("submit", "tiny_cpu", "--dry-run", f"launch.command=[python3, tool.py, --api-key, {value}]")
    assert r2.returncode == 2 and r2.stderr.startswith("slipway: error: launch.command[3]: looks like"), r2.stderr
    r3 = run("submit", "tiny_cpu", "--dry-run", f"launch.pre_launch=[curl -H 'Authorization: Bearer {value}' x]")
    assert r3.returncode == 0 and "slipway: warning: launch.pre_launch[0] holds what looks like" in r3.stderr
    assert not any(body in x for x in (r.stdout, r.stderr, r2.stdout, r2.stderr, r3.stdout, r3.stderr))
    assert tree(project) == before


# ------------------------------------------------------------------ the user's own text


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_pre_launch_is_the_user_s_own_text_and_is_warned_about_by_line(project, host, capfd, runtime):
    value, body = shaped("huggingface")
    line = f"huggingface-cli login --token {value}"
    args = ["tiny_cpu", *runtime_args(project, runtime), f"launch.pre_launch=[echo hi, {line}]", "--run-name", "own"]
    for command in (["submit", "--dry-run"], ["submit"]):
        rc, out, err = slipway(capfd, *command, *args)
        assert rc == 0, err
        warnings = [w for w in err.splitlines() if w.startswith("slipway: warning:")]
        assert len(warnings) == 1 and "launch.pre_launch[1] holds what looks like a secret (Hugging Face Token)" in warnings[0]
        assert body not in out + err  # a dry run prints job.sbatch masked
    assert line in (project / "runs" / "own" / "job.sbatch").read_text()  # written as the user wrote it


def test_a_hand_written_edf_is_warned_about_by_line_and_never_printed(project, host, capfd, tmp_path):
    value, body = shaped("github classic")
    edf = tmp_path / "mine.toml"
    edf.write_text(f'image = {json.dumps(str(project / "img.sqsh"))}\n[env]\nFOO = "1"\nGH_TOKEN = "{value}"\n'
                   f'DB_PASSWORD = "hunter2"\nOK = "${{WANDB_API_KEY}}"\n'
                   '[annotations]\n"com.hooks.ssh.authorize_ssh_key" = "/keys/id.pub"\n')
    rc, out, err = slipway(capfd, "edf", "--check", str(edf))
    assert rc == 0 and f"{edf}: ok" in out, err
    warnings = [w for w in err.splitlines() if w.startswith("slipway: warning:")]
    assert [w.split(" holds")[0] for w in warnings] == [f"slipway: warning: {edf} line 4",
                                                          f"slipway: warning: {edf} line 5"], err
    assert "GitHub Token" in warnings[0] and 'write "${GH_TOKEN}"' in warnings[0]
    assert 'write "${DB_PASSWORD}"' in warnings[1]
    rc, out, err = slipway(capfd, "edf", "--to-pyxis", str(edf))
    assert rc == 0, err
    assert "export GH_TOKEN=<hidden>" in out and "export DB_PASSWORD=<hidden>" in out
    assert body not in out + err and "hunter2" not in out + err


# ------------------------------------------------------------------ small things the policy's fields brought


@pytest.mark.parametrize("runtime", ["edf", "none"])
def test_a_literal_dollar_brace_is_no_expansion(project, host, capfd, runtime):
    """`$${VAR}` is the documented literal `${VAR}` of EDF text: container.env takes it even for a
    secret's name (nothing is expanded); launch.env is shell text, where it would expand."""
    args = ["tiny_cpu", *runtime_args(project, runtime)[:-1]]
    rc, out, err = slipway(capfd, "submit", "--dry-run", *args, "container.env.GREETING=$${HF_TOKEN} and $${X}")
    assert rc == 0, err
    if runtime == "edf":
        assert 'GREETING = "$${HF_TOKEN} and $${X}"' in out
    rc, _, err = slipway(capfd, "submit", "--dry-run", *args, "launch.env.GREETING=$${HF_TOKEN}")
    assert rc == 2 and err.startswith("slipway: error: launch.env.GREETING: expands ${HF_TOKEN}"), err


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_pythonpath_from_the_host_stays_behind_the_code_snapshot(project, host, capfd, runtime, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/site/lib")
    rc, out, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", *runtime_args(project, runtime)[:-1],
                           "container.env_from_host=[PYTHONPATH]")
    assert rc == 0, err
    if runtime == "edf":  # the snapshot first, then the host's, which the Container Engine expands
        line = next(x for x in out.splitlines() if x.startswith("PYTHONPATH = "))
        assert "/runs/.code/" in line and line.endswith(':${PYTHONPATH}"'), line
    if runtime == "pyxis":
        srun = next(x for x in out.splitlines() if "srun --kill-on-bad-exit=1" in x)
        assert " PYTHONPATH=" in srun and srun.index(".code/") < srun.index('"${PYTHONPATH}"'), srun
    assert "/site/lib" not in out  # passed by name, never written


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_integer_beyond_every_bound_names_the_field_s_own(project, host, capfd, runtime):
    for value in (2 ** 64, 10 ** 39, -(2 ** 64)):
        rc, _, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", *runtime_args(project, runtime)[:-1],
                             f"container.keep_builds={value}")
        assert rc == 2 and err.startswith("slipway: error: container.keep_builds: expected a whole number from 0 "
                                          "to 100"), err
    # a field with no bound of its own is held to the engine's
    rc, _, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", f"run.seed={2 ** 64}")
    assert rc == 2 and "between -9007199254740991 and 9007199254740991" in err, err


# ------------------------------------------------------------------ the hostile corpus: every shape, every field


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_on_the_command_line_is_refused_and_never_echoed(project, host, capfd, shape):
    """A CLI override, as the shell hands it over, in a field whose own check would refuse the value
    for another reason (slurm.time: not a time) and quote it: refused as a secret first, in one
    line that names the field and never the value; nothing written."""
    value, body = shaped(shape)
    before = tree(project)
    for override in (f"slurm.time={value}", f"container.env.SOME_NAME={value}"):
        field = override.split("=", 1)[0]
        rc, out, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", override)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"slipway: error: {field}"), (shape, err)
        assert body not in out + err, (shape, field, err)
    assert tree(project) == before


def test_a_name_in_no_case_s_convention_is_a_secret_s_name(project, host, capfd):
    for override, field in (("container.env.hF_tOkEn=abc123", "container.env.hF_tOkEn"),
                            ("launch.env.wAnDb_ApI_kEy=abc123", "launch.env.wAnDb_ApI_kEy"),
                            ("launch.command=[python3, t.py, --hF-tOkEn, abc123]", "launch.command[3]")):
        rc, out, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", override)
        assert rc == 2 and err.startswith(f"slipway: error: {field}: looks like a secret"), err
        assert "abc123" not in out + err


def test_a_hash_under_its_name_passes_and_the_same_hex_alone_does_not(project, host, capfd):
    commit = secrets.token_hex(20)
    rc, out, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", f"image.build_args.GIT_COMMIT={commit}",
                           "launch.launcher=srun", f"launch.command=[python3, t.py, --revision, {commit}]")
    assert rc == 0, err
    rc, out, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", f"launch.command=[python3, t.py, {commit}]")
    assert rc == 2 and err.startswith("slipway: error: launch.command[2]: looks like a random key (Hex High Entropy String)"), err
    assert commit not in out + err


def _in_every_field(value: str, shape: str) -> typing.Iterator[tuple[str, dict]]:
    for dotted, tp, kind in FIELDS:
        if not _judged(shape, kind):
            continue
        origin = typing.get_origin(tp)
        if origin is list:
            yield f"{dotted}[0]", {dotted: [value]}
        elif origin is dict:
            yield f"{dotted}.SOME_NAME", {dotted: {"SOME_NAME": value}}
        else:
            yield dotted, {dotted: value}


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_in_every_field_is_refused_at_the_one_edge(project, shape):
    """The whole cross product (every shape of the corpus x every field of the config) through the
    edge every command reads a config by (jobs.config.load_config, what `test_a_secret_by_shape_is_
    refused_in_every_field` samples through each command): refused naming the field, never quoting."""
    from common.errors import ConfigError
    from jobs.config import load_config

    value, body = shaped(shape)
    missed = []
    for field, sets in _in_every_field(value, shape):
        try:
            load_config("tiny_cpu", sets=sets)
        except ConfigError as exc:
            if not str(exc).startswith(f"{field}: ") or body in str(exc):
                missed.append((field, str(exc)))
            continue
        missed.append((field, "accepted"))
    assert not missed, (shape, missed[:5])
