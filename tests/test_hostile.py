"""Nothing crashes: hostile input gets one line and exit 2, or renders a script that runs no
injected command.

The property tests derive their inputs from the config tree itself (every str, int, float,
bool, list and dict field of `jobs.config.Config`, found by walking its dataclasses), so a new
field is covered without editing this file; EDF documents are generated the same way. The
plain tests below them pin each finding of issue 19 (alias bomb, huge files, long path
components, deep nesting, huge numbers, `edf --check`, `--to-pyxis` defaults, `prepare --as-job`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shlex
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from conftest import SRUN_PASSING_PREFLIGHT, tree
from jobs.cli import main
from jobs.config import Config, load_config
from common.errors import ConfigError, one_line
from common.schema import config_fields
from common.yaml import read_yaml

pytestmark = pytest.mark.slow
PY = sys.executable
LONGEST_LINE = 1500  # an error line quotes a value cut to ~80 characters, plus paths of this machine
MARKER = "pwned"  # what an injected `touch pwned` would create
# Examples per property test: enough for the whole file to take well under a minute; raise it
# (SLIPWAY_HOSTILE_EXAMPLES=2000) for a deeper search after touching the config tree.
EXAMPLES = int(os.environ.get("SLIPWAY_HOSTILE_EXAMPLES", "80"))

# What a user (or an attacker's file) might type where a string goes.
INJECTIONS = [f"$(touch {MARKER})", f"`touch {MARKER}`", f"'; touch {MARKER}; '", f'"; touch {MARKER}; "',
              f"\n touch {MARKER}\n", f"${{X:-$(touch {MARKER})}}", "${X}", "${HOME}", "$$", "\0", "\r\n", "'", '"',
              "\\", "%j", "--exclusive", "a,b", "é🙂", "\u202e", "x" * 300, "/" + "y" * 300 + "/z", "/" * 5000]
HOSTILE_TEXT = st.one_of(st.sampled_from(INJECTIONS), st.text(max_size=30),
                         st.lists(st.sampled_from(INJECTIONS), min_size=1, max_size=3).map("".join))
HUGE_INT = st.one_of(st.integers(-10, 10), st.sampled_from([2 ** 31, 2 ** 63, -2 ** 63, 10 ** 30, 10 ** 400]),
                     st.integers())
NUMBER_TEXT = st.sampled_from(["1e999", "-1e999", ".nan", "9" * 5000, "0x" + "f" * 40, "1_000", "+-1", "½", "²"])


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted field, type) for every field of the config tree below `cls`."""
    out = []
    hints = typing.get_type_hints(cls)
    for name in config_fields(cls):
        tp, path = hints[name], f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            out += _leaves(tp, f"{path}.")
        else:
            out.append((path, tp))
    return out


FIELDS = _leaves(Config)


def _values(tp: Any, depth: int = 0) -> st.SearchStrategy:
    """Hostile values for a field of type `tp`: of its own type, and of every other shape."""
    origin = get_origin(tp)
    anything = st.one_of(HOSTILE_TEXT, HUGE_INT, NUMBER_TEXT, st.booleans(), st.none(), st.floats())
    if origin in (Union, types.UnionType):
        own = st.one_of(*(_values(a, depth) for a in get_args(tp) if a is not type(None)))
    elif origin is Literal:
        own = st.sampled_from(get_args(tp))
    elif origin is list:
        item = _values(get_args(tp)[0], depth + 1) if depth < 2 else anything
        nested = st.recursive(item, lambda inner: st.lists(inner, max_size=3), max_leaves=6)
        own = st.one_of(st.lists(item, max_size=4), st.lists(nested, max_size=2))
    elif origin is dict:
        own = st.dictionaries(HOSTILE_TEXT, _values(get_args(tp)[1], depth + 1) if depth < 2 else anything,
                              max_size=3)
    elif tp is int:
        own = st.one_of(HUGE_INT, NUMBER_TEXT)
    elif tp is float:
        own = st.one_of(st.floats(), NUMBER_TEXT, HUGE_INT)
    elif tp is bool:
        own = st.booleans()
    else:  # str, and the classes with a text form of their own (mounts, true/false/auto)
        own = HOSTILE_TEXT
    return st.one_of(own, own, anything)  # mostly well-shaped, so the checks behind the type check run too


def _set(raw: dict, dotted: str, value: Any) -> None:
    node = raw
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


CHANGES = st.lists(st.sampled_from(FIELDS).flatmap(lambda f: st.tuples(st.just(f[0]), _values(f[1]))),
                   min_size=1, max_size=3)
RUNTIMES = st.sampled_from(["none", "edf", "pyxis"])


def cli(*args: str) -> tuple[int, str, str]:
    """`slipway ARGS` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def assert_refused_in_one_line(code: int, err: str, what: Any = "") -> None:
    assert code == 2, (code, err, what)
    lines = err.strip().splitlines()
    error_lines = [line for line in lines if line.startswith("slipway: error: ")]
    assert len(error_lines) == 1 and "Traceback" not in err, (err, what)
    assert all(len(line) <= LONGEST_LINE for line in lines), (max(map(len, lines)), what)
    assert "bug in slipway" not in err, (err, what)


def refused_in_the_verdict(code: int, out: str, err: str) -> bool:
    """A dry run that read its input whole and refuses the submission says so in its verdict
    (stdout, exit 2), one line per reason, rather than as an error."""
    if not (code == 2 and not err and "would be refused" in out):
        return False
    assert not _raw_controls(out), _raw_controls(out)
    reasons = [line for line in out.splitlines() if line.startswith("  - ")]
    assert reasons and all(len(line) <= LONGEST_LINE for line in reasons), reasons
    return True


def write_config(path: Path, raw: dict) -> None:
    path.write_text(yaml.safe_dump(raw, allow_unicode=True, sort_keys=False))


@pytest.fixture
def stand_ins(tmp_path) -> Path:
    """srun/scontrol/sinfo stand-ins for running a batch script outside Slurm."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\n" + SRUN_PASSING_PREFLIGHT +
                                  'for a in "$@"; do printf "%s\\n" "$a"; done > "$RUN_DIR/srun-args"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1" = show ] && echo node1\nexit 0\n')
    (bin_dir / "sinfo").write_text("#!/bin/bash\necho 'node1 alloc'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


@pytest.fixture
def slurm_up(tmp_path, monkeypatch):
    """sbatch/scontrol stand-ins on PATH (for this process and its plumbum commands) that take a
    job and answer the controller's ping, so a refusal comes from the input, not from Slurm."""
    from plumbum import local

    bin_dir = tmp_path / "fake-slurm"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/bash\necho 4242\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1" = ping ] && echo "Slurmctld(primary) at c is UP"\n'
                                      'exit 0\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    monkeypatch.setenv("PATH", path)
    with local.env(PATH=path):
        yield bin_dir


def run_script(run_dir: Path, bin_dir: Path, cwd: Path) -> None:
    """The run's job.sbatch through `bash -n`, then run by bash with the stand-ins."""
    script = run_dir / "job.sbatch"
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "17", "SLURM_JOB_NODELIST": "node1",
           "SLURM_NNODES": "1", "HOME": str(cwd), "RUN_DIR": str(run_dir)}
    # Output to a file, not a pipe: a helper the script starts in the background (and kills) may
    # leave a child holding a pipe open for a while.
    with open(cwd / "script.log", "w") as log:
        subprocess.run(["bash", str(script)], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, timeout=60)


# --------------------------------------------------------------------------
# Property tests: the config tree and EDF documents, generated.
# --------------------------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(changes=CHANGES, runtime=RUNTIMES)
def test_any_config_is_refused_in_one_line_or_renders_a_safe_script(project, stand_ins, changes, runtime):
    from jobs import runs
    from jobs.runs.container import create_needed_dirs

    image = project / "img.sqsh"
    image.write_bytes(b"hsqs")
    raw = yaml.safe_load((project / "configs" / "tiny_cpu.yaml").read_text())
    _set(raw, "container.runtime", runtime)
    _set(raw, "container.image", str(image))
    name = f"h{abs(hash(json.dumps(repr(changes)))) % 10 ** 9}"
    _set(raw, "run.name", name)
    for dotted, value in changes:
        _set(raw, dotted, value)
    path = project / "configs" / "hostile.yaml"
    try:
        write_config(path, raw)
    except (yaml.YAMLError, ValueError):
        event("not writable as YAML")
        return  # PyYAML cannot write it (e.g. a NUL inside a key): nobody can hand it to slipway either
    before = tree(project / "runs") if (project / "runs").exists() else []
    code, out, err = cli("submit", str(path), "--dry-run")
    if refused_in_the_verdict(code, out, err):
        event("read, its submission refused")
    elif code != 0:
        assert_refused_in_one_line(code, err, changes)
        event(f"refused: {err.split(': ')[2].split('.')[0].split('[')[0]}")
        return
    after = tree(project / "runs") if (project / "runs").exists() else []
    assert after == before, "a dry run wrote files"
    # Accepted: the real render, written into its run directory, must parse and inject nothing.
    cfg = load_config(path)
    try:
        sealed = runs.seal(cfg, project)
        runs.check_submittable(sealed.cfg)
        create_needed_dirs(sealed.cfg, sealed.paths)
        run, _ = runs.prepare_run(sealed, force=True)
    except ConfigError as exc:  # a check only a real submission makes (a mount source): one line too
        assert "\n" not in str(exc) and len(str(exc)) <= LONGEST_LINE
        return
    event(f"rendered and run ({runtime})")
    run_script(run.dir, stand_ins, project.parent)
    if any(dotted == "launch.pre_launch" for dotted, _ in changes):
        # the user's own shell lines, run as written (docs/config.md): a command there is theirs
        for made in project.parent.rglob(f"{MARKER}*"):
            made.unlink()
        return
    assert not list(project.parent.rglob(f"{MARKER}*")), f"a value ran a command: {changes}"


OVERRIDE_TEXT = st.one_of(HOSTILE_TEXT, NUMBER_TEXT, HUGE_INT.map(str),
                          st.lists(HOSTILE_TEXT, max_size=3).map(lambda items: "[" + ", ".join(items) + "]"),
                          HOSTILE_TEXT.map(lambda t: "{" + t), HOSTILE_TEXT.map(lambda t: "[" + t),
                          st.sampled_from(['["a', "{a: *b}", "{a: &b [1], c: *b}", "[a, 'b]",
                                           "{!!python/name:os.system: 1}"]))
OVERRIDE_KEY = st.one_of(st.sampled_from([f for f, _ in FIELDS]), HOSTILE_TEXT,
                         st.sampled_from([f for f, _ in FIELDS]).map(lambda f: f + ".x"))


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(overrides=st.lists(st.tuples(OVERRIDE_KEY, OVERRIDE_TEXT), min_size=1, max_size=3))
@example(overrides=[("data.tokenizer", "$(touch pwned)")])  # read whole, refused in the dry run's verdict
def test_any_override_is_refused_in_one_line_or_accepted(project, overrides):
    args = [f"{key}={value}" for key, value in overrides if not key.startswith("-") and "\0" not in key + value]
    code, out, err = cli("submit", "tiny_cpu", "--dry-run", *args)
    if code != 0 and not refused_in_the_verdict(code, out, err):
        assert_refused_in_one_line(code, err, args)
    assert not (project / "runs").exists()


EDF_KEYS = {"image": str, "workdir": str, "writable": bool, "entrypoint": bool, "mounts": list[str],
            "env": dict[str, str], "annotations": dict[str, str], "base_environment": list[str]}
TOML_VALUE = st.recursive(st.one_of(HOSTILE_TEXT, HUGE_INT.filter(lambda n: abs(n) < 2 ** 63), st.booleans(),
                                    st.floats(allow_nan=False)),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.text(min_size=1, max_size=5), inner,
                                                                  max_size=3)), max_leaves=8)


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(doc=st.dictionaries(st.sampled_from([*EDF_KEYS, "unknown"]),
                           st.one_of(*(_values(tp) for tp in EDF_KEYS.values()), TOML_VALUE), max_size=4))
@example(doc={"base_environment": "\x85"})  # a line break to str.splitlines(), in the file name quoted
@example(doc={"base_environment": "a\u2028b\x1b[2J"})
def test_any_edf_is_refused_in_one_line_or_converted(tmp_path_factory, doc):
    import tomli_w

    doc = {k: v for k, v in doc.items() if v is not None}
    try:
        text = tomli_w.dumps(doc)
    except (TypeError, ValueError):
        return  # not TOML at all (None inside a list)
    path = tmp_path_factory.mktemp("edf") / "env.toml"
    path.write_text(text)
    for flag in ("--check", "--to-pyxis"):
        code, out, err = cli("edf", flag, str(path))
        if code == 0:
            assert "Traceback" not in err
            continue
        assert code == 2, (code, err, doc)
        lines = err.strip().splitlines()
        assert lines and all(line.startswith(("slipway: error: ", "note: ")) or line.endswith("problem(s)")
                             for line in lines), (err, doc)
        assert all(len(line) <= LONGEST_LINE for line in lines) and "bug in slipway" not in err, (err, doc)


# --------------------------------------------------------------------------
# The findings of issue 19, one by one.
# --------------------------------------------------------------------------


def _bomb(levels: int = 9) -> str:
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, levels + 1):
        text += f"{chr(97 + i)}: &{chr(97 + i)} [" + ",".join([f"*{chr(96 + i)}"] * 9) + "]\n"
    return text


def peak_bytes(work) -> tuple[Any, int]:
    """(what `work()` returned or raised, the most memory it held at once): how a test tells that
    an input was refused before it was expanded or read whole, on any machine at any load."""
    import tracemalloc

    tracemalloc.start()
    try:
        try:
            result = work()
        except Exception as exc:  # the refusal is the result
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_alias_bomb_is_refused_at_once(project):
    """Nine levels of nine aliases are 3.5e9 list items expanded: refused before, in a few MiB."""
    refused, peak = peak_bytes(lambda: read_yaml(_bomb(), "bomb.yaml"))
    assert isinstance(refused, ConfigError) and "aliases" in str(refused) and peak < 16 << 20, (refused, peak)
    (project / "configs" / "bomb.yaml").write_text(_bomb() + "train:\n  steps: *j\n")
    (code, _, err), peak = peak_bytes(lambda: cli("submit", "bomb", "--dry-run"))
    assert peak < 64 << 20, peak
    assert_refused_in_one_line(code, err)
    assert "bomb.yaml line" in err and len(err) < 400


def test_a_few_aliases_still_work():
    raw = read_yaml("base: &b {steps: 5}\ntrain: *b\nother: [*b, *b]\n", "ok.yaml")
    assert raw["train"] == {"steps": "5"} and raw["other"] == [{"steps": "5"}] * 2


def test_a_huge_config_is_refused_fast(project):
    path = project / "configs" / "huge.yaml"
    path.write_text((project / "configs" / "tiny_cpu.yaml").read_text() + "#" + "x" * 20_000_000 + "\n")
    (code, _, err), peak = peak_bytes(lambda: cli("submit", "huge", "--dry-run"))
    assert peak < 16 << 20, peak  # refused before the 20 MB file was read whole
    assert_refused_in_one_line(code, err)
    assert "larger than" in err
    code, _, err = cli("submit", "tiny_cpu", "--dry-run", "container.env={A: '" + "x" * 1_100_000 + "'}")
    assert_refused_in_one_line(code, err)


@pytest.mark.parametrize("text", ["train:\n  steps: " + "[" * 3000 + "]" * 3000 + "\n",
                                  "train:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)),
                                  "a: &a " + "[" * 20 + "1" + "]" * 20 + "\nb: " + "[" * 20 + "*a" + "]" * 20 + "\n"])
def test_deep_nesting_is_refused_in_one_line(project, text):
    (project / "configs" / "deep.yaml").write_text(text)
    code, _, err = cli("submit", "deep", "--dry-run")
    assert_refused_in_one_line(code, err)
    assert "nested deeper than 32 levels" in err


LONG = "/" + "n" * 300 + "/x"


@pytest.mark.parametrize("override", [f"container.image={LONG}.sqsh", f"container.mounts=[{LONG}:/dst]",
                                      f"train.script={LONG}.py", f"data.dataset={LONG}", f"data.tokenizer={LONG}",
                                      f"data.cache_dir={LONG}", f"launch.hf_home={LONG}",
                                      f"model.init_from_hf={LONG}", f"data.validation_split={LONG}"])
@pytest.mark.parametrize("runtime", ["edf", "pyxis"])
def test_a_path_component_too_long_is_one_line(project, override, runtime, slurm_up):
    image = project / "img.sqsh"
    image.write_bytes(b"hsqs")
    args = ["tiny_cpu", f"container.runtime={runtime}", f"container.image={image}", override]
    field = override.split("=")[0]
    code, _, err = cli("submit", *args, "--dry-run")
    assert_refused_in_one_line(code, err, override)
    assert err.startswith(f"slipway: error: {field}") and "at most 255" in err, err
    before = tree(project)
    code, _, err = cli("prepare", *args, "--as-job")
    assert_refused_in_one_line(code, err, override)
    assert err.startswith(f"slipway: error: {field}"), err
    assert tree(project) == before  # nothing half-made


def test_an_os_error_on_a_path_is_one_line_naming_the_path(project):
    long_name = "c" * 300
    code, _, err = cli("submit", f"{long_name}.yaml", "--dry-run")  # the config file itself
    assert_refused_in_one_line(code, err)
    assert "shorten" in err or "not a usable path" in err
    deep = "/" + "/".join(["d" * 250] * 20)  # each name fits, the whole path does not (PATH_MAX)
    code, _, err = cli("submit", "tiny_cpu", "--dry-run", f"data.dataset={deep}")
    assert_refused_in_one_line(code, err)
    assert "File name too long" in err and len(err) < 600  # the path cut to its start and end
    r = subprocess.run([PY, "-m", "trainer.prepare", "--config", f"{deep}/config.yaml"], capture_output=True,
                       text=True, cwd=project, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("override, field", [
    ("slurm.time=99999999:00:00", "slurm.time"), ("slurm.time=366-00:00:00", "slurm.time"),
    ("slurm.time=" + "9" * 5000, "slurm.time"), ("slurm.prepare_time=9999999", "slurm.prepare_time"),
    ("slurm.max_retries=99999999999999999999", "slurm.max_retries"), ("slurm.max_retries=101", "slurm.max_retries"),
    ("slurm.max_requeues=1000000", "slurm.max_requeues"), ("slurm.nodes=10000000", "slurm.nodes"),
    ("slurm.gpus_per_node=1000", "slurm.gpus_per_node"), ("slurm.cpus_per_task=100000", "slurm.cpus_per_task"),
    ("slurm.signal_seconds=70000", "slurm.signal_seconds"),
    ("slurm.preflight_timeout=10000000", "slurm.preflight_timeout"),
    ("train.steps=" + "9" * 5000, "train.steps"), ("train.steps=10000000000", "train.steps"),
    ("train.hang_timeout=1e999", "train.hang_timeout"), ("train.lr=.nan", "train.lr"),
    ("checkpoint.interval=10000000000", "checkpoint.interval"), ("logging.interval=10000000000", "logging.interval"),
    ("train.selective_ac=²", "train.selective_ac"), ("run.seed=" + "1" * 60, "run.seed"),
])
def test_numbers_are_bounded_by_what_slurm_and_the_trainer_take(project, override, field):
    code, _, err = cli("submit", "tiny_cpu", "--dry-run", override)
    assert_refused_in_one_line(code, err, override)
    assert err.startswith(f"slipway: error: {field}:"), err
    assert len(err) < 400


def test_the_longest_time_limit_is_accepted(project):
    code, out, err = cli("submit", "tiny_cpu", "--dry-run", "slurm.time=365-00:00:00")
    assert code == 0, err
    assert "--time=365-00:00:00" in out


def test_an_error_never_prints_a_value_whole(project):
    code, _, err = cli("submit", "tiny_cpu", "--dry-run", "slurm.account=" + "a," * 50_000)
    assert_refused_in_one_line(code, err)
    assert len(err) < 400 and "..." in err


def test_an_unexpected_error_says_it_is_a_bug(project, monkeypatch):
    import jobs.runs

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(jobs.runs, "seal", broken)
    code, _, err = cli("submit", "tiny_cpu", "--dry-run")
    assert code == 70 and err.count("\n") == 1
    assert "bug in slipway" in err and "SLIPWAY_DEBUG=1" in err
    monkeypatch.setenv("SLIPWAY_DEBUG", "1")
    with pytest.raises(KeyError):
        main(["submit", "tiny_cpu", "--dry-run"])


def test_edf_check_reports_missing_files_and_what_it_cannot_judge(tmp_path, monkeypatch):
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    monkeypatch.delenv("IMG", raising=False)
    here = tmp_path / "here"
    here.mkdir()
    path = tmp_path / "env.toml"
    path.write_text(f'image = "${{IMG:-{tmp_path}/missing.sqsh}}"\n'
                    f'mounts = ["{tmp_path}/gone:/a", "${{NOT_SET_HERE}}/x:/b", "{here}:/c"]\n')
    code, out, err = cli("edf", "--check", str(path))
    assert code == 2 and out == ""
    assert f"slipway: error: {path}:image: image file '{tmp_path}/missing.sqsh'" in err
    assert f"slipway: error: {path}:mounts[0]: mount source '{tmp_path}/gone' does not exist" in err
    assert f"note: {path}:mounts[1]: cannot judge mount source" in err and "mounts[2]" not in err
    (tmp_path / "missing.sqsh").write_bytes(b"hsqs")
    (tmp_path / "gone").mkdir()
    code, out, err = cli("edf", "--check", str(path))
    assert code == 0 and out.startswith(f"{path}: ok (1 path(s) not judged"), err


def test_to_pyxis_keeps_a_default_image_intact(tmp_path):
    path = tmp_path / "env.toml"
    path.write_text('image = "${IMG:-/capstor/x.sqsh}"\n')
    code, out, err = cli("edf", "--to-pyxis", str(path))
    assert code == 0, err
    assert "--container-image=${IMG:-/capstor/x.sqsh}" in shlex.split(out)  # the words bash sees
    path.write_text('image = "nvcr.io/nvidia/pytorch:${TAG:-25.12-py3}"\n')
    code, out, err = cli("edf", "--to-pyxis", str(path))
    assert code == 0 and "--container-image=nvcr.io#nvidia/pytorch:${TAG:-25.12-py3}" in shlex.split(out), err


@pytest.mark.parametrize("text", ["a = " + "[" * 3000 + "]" * 3000 + "\n", "[" + ".".join(["t"] * 3000) + "]\n",
                                  "[annotations." + ".".join(["a"] * 100) + "]\nx = \"1\"\n",
                                  "image = \"/x.sqsh\"\n#" + "x" * 50_000_000 + "\n"])
def test_a_deep_or_huge_edf_is_refused_fast(tmp_path, text):
    path = tmp_path / "env.toml"
    path.write_text(text)
    for flag in ("--check", "--to-pyxis"):
        (code, _, err), peak = peak_bytes(lambda: cli("edf", flag, str(path)))
        assert peak < 16 << 20, peak  # never read whole, nor its nesting built
        assert code == 2 and "Traceback" not in err and max(map(len, err.splitlines())) < 400, err
        assert "nested deeper than 32" in err or "larger than" in err, err


def test_prepare_as_job_refused_leaves_no_directories(project, slurm_up):
    image = project / "img.sqsh"
    image.write_bytes(b"hsqs")
    before = tree(project)
    code, _, err = cli("prepare", "tiny_cpu", "--as-job", "container.runtime=edf", f"container.image={image}",
                       f"data.dataset={project}/no/such/dataset")
    assert_refused_in_one_line(code, err)
    assert err.startswith("slipway: error: data.dataset:")
    assert tree(project) == before, "the cache directories made before the refusal are still there"


def test_the_same_edge_for_python_m_containers(project):
    r = subprocess.run([PY, "-m", "jobs", "image", "show", "tiny_cpu", f"image.dockerfile={LONG}"],
                       capture_output=True, text=True, cwd=project, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("slipway: error: "), r.stderr


def test_prepare_as_job_refused_by_an_existing_run_leaves_no_directories(project, slurm_up):
    import shutil

    image = project / "img.sqsh"
    image.write_bytes(b"hsqs")
    args = ["prepare", "tiny_cpu", "--as-job", "container.runtime=edf", f"container.image={image}", "--run-name", "p1"]
    code, out, err = cli(*args)
    assert code == 0 and "4242" in out, err
    shutil.rmtree(project / ".cache")
    before = tree(project)
    code, _, err = cli(*args, "train.steps=7")  # a different config for the same run: refused
    assert_refused_in_one_line(code, err)
    assert err.startswith("slipway: error: run.name:") and tree(project) == before
    code, out, err = cli(*args, "train.steps=7", "--force", "--parsable")  # replaced; the job id alone on stdout
    assert (code, out) == (0, "4242\n"), (out, err)
    assert "steps: 7" in (project / "runs" / "p1" / "config.yaml").read_text()


# --------------------------------------------------------------------------
# One escaping rule at every sink (issue 50): a control character in any field.
# --------------------------------------------------------------------------

CONTROLS = ["\x1b", "\x07", "\r", "\n", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069"]


def _raw_controls(text: str) -> list[str]:
    """The characters in `text` that `one_line` would escape, line ends apart (a file's own lines)."""
    return sorted({c for c in text if c != "\n" and one_line(c) != c})


def _free_text(dotted: str) -> bool:
    """Whether the schema declares field `dotted` free text (common/schema.py FREE_TEXT)."""
    cls, *parts = [Config, *dotted.split(".")]
    for part in parts[:-1]:
        cls = typing.get_type_hints(cls)[part]
    return config_fields(cls)[parts[-1]].metadata.get("free_text", False)


def _holding(tp: Any, text: str) -> Any:
    """A value of field type `tp` (a list's item, a mapping's value) that holds `text`."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return _holding(next(a for a in get_args(tp) if a is not type(None)), text)
    if origin is list:
        return [_holding(get_args(tp)[0], text)]
    if origin is dict:
        return {"SLIPWAY_X": _holding(get_args(tp)[1], text)}
    return f"/a{text}b:/c" if getattr(tp, "__name__", "") == "Mount" else text


@pytest.mark.parametrize("char", CONTROLS, ids=[one_line(c) for c in CONTROLS])
@pytest.mark.parametrize("runtime", ["edf", "pyxis"])
def test_a_control_character_in_any_field_is_refused_where_it_enters_or_escaped_at_every_sink(project, char, runtime):
    """Every field of the config tree given a value holding `char`: a name, a path or a Slurm value
    refuses it in one line naming the field; free text takes it but a line break, and no sink shows
    it raw: the dry run's terminal output, the batch script, the EDF file."""
    from jobs import runs

    base = yaml.safe_load((project / "configs" / "tiny_cpu.yaml").read_text())
    _set(base, "container.runtime", runtime)
    _set(base, "container.image", str(project / "img.sqsh"))
    (project / "img.sqsh").write_bytes(b"hsqs" + bytes(1000))  # a dry run refuses a missing image (exit 2)
    path = project / "configs" / "hostile.yaml"
    taken = []
    for dotted, tp in FIELDS:
        raw = json.loads(json.dumps(base))
        _set(raw, dotted, _holding(tp, f"a{char}b"))
        write_config(path, raw)
        code, out, err = cli("submit", str(path), "--dry-run")
        assert not _raw_controls(out + err), (dotted, _raw_controls(out + err), out[-500:], err)
        if not _free_text(dotted) or char in "\r\n":
            assert_refused_in_one_line(code, err, dotted)
            assert err.startswith(f"slipway: error: {dotted}") and ("control character" in err or "line break" in err), err
            continue
        assert code == 0, (dotted, err, out[-1500:])
        sealed = runs.seal(load_config(path), project, dry_run=True)
        for file, text in sealed.files.items():
            assert not _raw_controls(text), (dotted, file.name, _raw_controls(text))
        taken.append(dotted)
    assert sorted(taken) == ([] if char in "\r\n" else ["container.annotations", "container.env", "image.build_args",
                                                         "launch.command", "launch.env"]), taken


@pytest.mark.parametrize("args, env, profiles, field", [
    (["--partition", "a\x1bb"], {}, {}, "slipway: error: slurm.partition: holds a control character (\\x1b)"),
    (["--text-column", "t\u202ex"], {}, {}, "slipway: error: data.text_column: holds a control character (\\u202e)"),
    (["--cluster", "alps\n"], {}, {}, "slipway: error: --cluster: 'alps\\n' is not a cluster name"),
    ([], {"SLIPWAY_CLUSTER": "alps\n"}, {}, "slipway: error: $SLIPWAY_CLUSTER: 'alps\\n' is not a cluster name"),
    (["--cluster", "alps"], {}, {"alps": {"slurm": {"account": "a\x07b"}}},
     "clusters.yaml alps.slurm.account: line 1: holds a control character (\\x07)"),
    (["--cluster", "alps"], {}, {"alps\n": {"slurm": {"qos": "q"}}}, "clusters.yaml 'alps\\n': is not a cluster name"),
])
def test_a_control_character_from_the_command_line_a_profile_or_the_environment_is_refused(project, args, env,
                                                                                           profiles, field):
    (project / "clusters.yaml").write_text(json.dumps(profiles))
    r = subprocess.run([PY, "-m", "jobs", "submit", "tiny_cpu", "--dry-run", *args], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=120)
    assert_refused_in_one_line(r.returncode, r.stderr, args)
    assert field in r.stderr and not _raw_controls(r.stderr), r.stderr
