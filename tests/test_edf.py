"""The environment model: EDF goldens and round trips, pyxis flags, base
environments, every rule's error, and atomic writes."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import assert_golden
from edf import Environment, Mount, check_edf, install_edf, parse_edf, render_edf, resolve_base
from edf.files import find_edf, write_edf
from edf.srun import to_pyxis_args
from common.errors import ConfigError
from common.schema import from_dict

# The CSCS nanotron tutorial's EDF, exactly as written there (trailing spaces
# included; eth-cscs/cscs-docs, tutorials/ml, "Set up an EDF").
TUTORIAL_EDF = """\
image = "/capstor/scratch/cscs/<USER>/container-image/nanotron/nanotron-v1.0.sqsh"
mounts = ["/capstor", "/users"]
workdir = "/users/<username>/" 
writable = true
 
[annotations]
com.hooks.aws_ofi_nccl.enabled = "true"
com.hooks.aws_ofi_nccl.variant = "cuda12"
 
[env]
FI_CXI_DISABLE_HOST_REGISTER = "1"
FI_MR_CACHE_MONITOR = "userfaultfd"
NCCL_DEBUG = "INFO"
"""

NANOTRON = Environment(
    image="/capstor/scratch/cscs/<USER>/container-image/nanotron/nanotron-v1.0.sqsh",
    mounts=[Mount("/capstor", "/capstor"), Mount("/users", "/users")],
    workdir="/users/<username>/",
    writable=True,
    env={"FI_CXI_DISABLE_HOST_REGISTER": "1", "FI_MR_CACHE_MONITOR": "userfaultfd", "NCCL_DEBUG": "INFO"},
    annotations={"com.hooks.aws_ofi_nccl.enabled": "true", "com.hooks.aws_ofi_nccl.variant": "cuda12"},
)

HOSTILE_DIR = "/scratch/my dir 'q' \"dq\" $(touch pwned) `x` back\\slash ünï 日本"
HOSTILE_VALUE = "a b'c\"d $(touch pwned) `touch pwned2` ; rm -rf / \\ ${HOME} end"
HOSTILE = Environment(
    image=f"{HOSTILE_DIR}/img 'v1'.sqsh",
    mounts=[Mount(HOSTILE_DIR, "/data dir/ü", ("ro", "private")), Mount("./rel $(x) ;", "./rel $(x) ;")],
    workdir=f"{HOSTILE_DIR}/work",
    writable=False,
    entrypoint=False,
    env={
        "GREETING": HOSTILE_VALUE,
        "MULTI": "line1\nline2\ttab\r\n",
        "UNICODE": "ünïcødé ✓ 日本 \u2028",
        "LITERAL": "cost $$5, $${HOME} stays",
        "DEFAULTED": "${MISSING:-} and ${OTHER:-x y}",
        "EMPTY": "",
    },
    annotations={"com.example.note": "quote \" backslash \\ newline\n end", "com.example.emoji": "✓"},
)

FULL = Environment(
    image="nvcr.io#nvidia/pytorch:25.01-py3",
    mounts=[
        Mount("${SCRATCH}", "${SCRATCH}"),
        Mount("${SCRATCH}/data.sqsh", "/data", ("sqsh",)),
        Mount("/capstor/store", "/store", ("ro", "rprivate", "nosuid")),
        Mount("${CACHE_DIR:-/tmp}", "/cache"),
    ],
    workdir="./work",
    writable=False,
    env={"PATH": "${PATH}:/custom/bin", "HF_HOME": "${SCRATCH}/hf"},
    annotations={
        "com.hooks.ssh.enabled": "true",
        "com.hooks.ssh.port": "15263",
        "com.pyxis.entrypoint_log": "true",
        "com.hooks.cxi.enabled": "false",
    },
    entrypoint=True,
    base_environment=["common", "./envs/extra.toml"],
)

GOLDENS = {"nanotron": NANOTRON, "hostile": HOSTILE, "full": FULL}


def one_line_error(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# --------------------------------------------------------------------------
# Render: goldens and round trips
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_render_golden(name):
    assert_golden(f"edf/{name}.toml", render_edf(GOLDENS[name]))


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_parse_render_round_trip(name):
    env = GOLDENS[name]
    text = render_edf(env)
    assert parse_edf(text) == env
    assert render_edf(parse_edf(text)) == text


def test_tutorial_edf_parses_to_the_model_and_renders_canonically():
    env = parse_edf(TUTORIAL_EDF)
    assert env == NANOTRON
    canonical = render_edf(env)
    assert canonical == render_edf(NANOTRON)
    assert parse_edf(canonical) == env
    assert render_edf(parse_edf(canonical)) == canonical


def test_annotation_forms_are_equivalent():
    dotted = '[annotations]\ncom.hooks.ssh.enabled = "true"\ncom.hooks.ssh.port = "22"\n'
    nested = '[annotations.com.hooks.ssh]\nenabled = "true"\nport = "22"\n'
    quoted = '[annotations]\n"com.hooks.ssh.enabled" = "true"\n"com.hooks.ssh.port" = "22"\n'
    envs = [parse_edf(text) for text in (dotted, nested, quoted)]
    assert envs[0] == envs[1] == envs[2]
    assert envs[0].annotations == {"com.hooks.ssh.enabled": "true", "com.hooks.ssh.port": "22"}
    assert render_edf(envs[0]) == nested


def test_base_environment_string_or_array_and_defaults():
    assert parse_edf('base_environment = "common"').base_environment == ["common"]
    assert parse_edf('base_environment = ["a", "b"]').base_environment == ["a", "b"]
    assert parse_edf('base_environment = ""').base_environment == []
    assert parse_edf("") == Environment()
    assert render_edf(Environment()) == ""


def test_mount_forms():
    assert Mount.parse("/a") == Mount("/a", "/a")
    assert Mount.parse("/a:/b") == Mount("/a", "/b")
    assert Mount.parse("/a:/b:ro+private") == Mount("/a", "/b", ("ro", "private"))
    assert Mount.parse("${A:-/x}:/b") == Mount("${A:-/x}", "/b")
    assert Mount.parse("/a:/a:ro").spec() == "/a:/a:ro"
    assert Mount("/a", "/a").spec() == "/a:/a"  # the documented SRC:DST form is what is written
    assert container(mounts=["/a:/b:ro"]).mounts == [Mount("/a", "/b", ("ro",))]


def container(**values) -> Environment:
    """The config's `container:` section, read as a config file's would be."""
    return from_dict(Environment, values, "container")


def test_the_config_section_is_the_model():
    env = container(image="./images/slipway.sqsh", mounts=["${SCRATCH}:${SCRATCH}", "/users"], workdir="/users",
                    env={"NCCL_DEBUG": "INFO"}, annotations={"com.hooks.aws_ofi_nccl.enabled": "true"})
    assert env == Environment(
        image="./images/slipway.sqsh", mounts=[Mount("${SCRATCH}", "${SCRATCH}"), Mount("/users", "/users")],
        workdir="/users", env={"NCCL_DEBUG": "INFO"},
        annotations={"com.hooks.aws_ofi_nccl.enabled": "true"},
    )
    assert parse_edf(render_edf(env)) == env
    from common.schema import to_dict

    assert to_dict(env)["mounts"] == ["${SCRATCH}:${SCRATCH}", "/users:/users"]
    assert "origin" not in to_dict(env) and "source" not in to_dict(env)


def test_config_section_with_bases_inherits_default_booleans():
    env = container(image="/i.sqsh", base_environment=["common"])
    assert (env.writable, env.entrypoint, env.mount_home) == (None, None, None)
    env = container(runtime="pyxis", image="/i.sqsh", base_environment=["common"], writable=False,
                    entrypoint=True, mount_home=True)
    assert (env.writable, env.entrypoint, env.mount_home) == (False, True, True)


def test_registry_forms_of_current_docs_are_accepted():
    """CSCS docs now write registry/image without '#'; the EDF keeps it, pyxis gets enroot's form."""
    for image, pyxis in [("nvcr.io/nvidia/pytorch:25.01-py3", "nvcr.io#nvidia/pytorch:25.01-py3"),
                         ("jfrog.svc.cscs.ch/docker-group-csstaff/alps-images/ngc-pytorch:26.02-py3-alps6",
                          "jfrog.svc.cscs.ch#docker-group-csstaff/alps-images/ngc-pytorch:26.02-py3-alps6"),
                         ("nvcr.io#nvidia/pytorch:25.01-py3", "nvcr.io#nvidia/pytorch:25.01-py3"),
                         ("user@localhost:5000/img:1", "user@localhost:5000#img:1"),
                         ("ubuntu:24.04", "ubuntu:24.04"), ("nvidia/cuda:12", "nvidia/cuda:12")]:
        env = parse_edf(f'image = "{image}"')
        assert render_edf(env) == f'image = "{image}"\n'
        assert to_pyxis_args(env).args[0] == f"--container-image={pyxis}"


# --------------------------------------------------------------------------
# pyxis
# --------------------------------------------------------------------------


def test_pyxis_nanotron():
    pyxis = to_pyxis_args(NANOTRON)
    assert pyxis.args == [
        "--container-image=/capstor/scratch/cscs/<USER>/container-image/nanotron/nanotron-v1.0.sqsh",
        "--container-mounts=/capstor:/capstor,/users:/users",
        "--container-workdir=/users/<username>/",
        "--container-writable",
        "--container-env=FI_CXI_DISABLE_HOST_REGISTER,FI_MR_CACHE_MONITOR,NCCL_DEBUG",
        "--no-container-mount-home",
        "--no-container-entrypoint",
    ]
    assert pyxis.exports == [("FI_CXI_DISABLE_HOST_REGISTER", "1"), ("FI_MR_CACHE_MONITOR", "userfaultfd"),
                             ("NCCL_DEBUG", "INFO")]
    assert len(pyxis.warnings) == 2
    assert all("has no pyxis equivalent" in w for w in pyxis.warnings)
    assert "annotations.com.hooks.aws_ofi_nccl.enabled" in pyxis.warnings[0]


PYXIS_HOSTILE = replace(HOSTILE, env={k: v for k, v in HOSTILE.env.items() if k not in ("MULTI", "LITERAL")}
                        | {"LITERAL": "cost $$5"})


def test_pyxis_hostile():
    pyxis = to_pyxis_args(PYXIS_HOSTILE)
    assert pyxis.args == [
        f"--container-image={HOSTILE_DIR}/img 'v1'.sqsh",
        f"--container-mounts={HOSTILE_DIR}:/data dir/ü:ro+private,./rel $(x) ;:./rel $(x) ;",
        f"--container-workdir={HOSTILE_DIR}/work",
        "--container-readonly",
        "--container-env=GREETING,UNICODE,DEFAULTED,EMPTY,LITERAL",
        "--no-container-mount-home",
        "--no-container-entrypoint",
    ]
    assert pyxis.exports == [
        ("GREETING", HOSTILE_VALUE),
        ("UNICODE", "ünïcødé ✓ 日本 \u2028"),
        ("DEFAULTED", "${MISSING:-} and ${OTHER:-x y}"),
        ("EMPTY", ""),
        ("LITERAL", "cost $5"),
    ]
    text = "\n".join(pyxis.warnings)
    assert "env.EMPTY is empty" in text
    assert "env.GREETING uses ${HOME}" in text
    assert "annotations.com.example.note" in text


def test_pyxis_flags_and_entrypoint_log():
    env = Environment(image="nvcr.io#nvidia/pytorch:25.01-py3", entrypoint=True, mount_home=True,
                      mounts=[Mount("${SCRATCH}", "/scratch", ("ro",))],
                      annotations={"com.pyxis.entrypoint_log": "true"})
    pyxis = to_pyxis_args(env)
    assert pyxis.args == [
        "--container-image=nvcr.io#nvidia/pytorch:25.01-py3",
        "--container-mounts=${SCRATCH}:/scratch:ro",
        "--container-writable",
        "--container-mount-home",
        "--container-entrypoint",
        "--container-entrypoint-log",
    ]
    assert pyxis.exports == [] and pyxis.warnings == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_pyxis_exports_reach_bash_as_the_container_engine_would_set_them():
    """Through the batch script's quoting, each export holds the value the EDF means."""
    from jobs.slurm.ranks import shell_value

    exports = to_pyxis_args(PYXIS_HOSTILE).exports
    script = "".join(f"export {name}={shell_value(value)}\n" for name, value in exports)
    script += "".join(f'printf "%s\\0" "${name}"\n' for name, _ in exports)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={"HOME": "/home/u", "OTHER": "set", "PATH": os.environ.get("PATH", "")})
    values = out.stdout.split("\0")[:-1]
    assert values == [
        HOSTILE_VALUE.replace("${HOME}", "/home/u"), "ünïcødé ✓ 日本 \u2028", " and set", "", "cost $5",
    ]


@pytest.mark.parametrize("env, field, needle", [
    (Environment(), "image", "pyxis needs an image"),
    (replace(NANOTRON, mounts=[Mount("/d.sqsh", "/data", ("sqsh",))]), "mounts[0]", "squashfs"),
    (replace(NANOTRON, mounts=[Mount("/a,b", "/c")]), "mounts[0]", "','"),
    (replace(NANOTRON, env={"X": "two\nlines"}), "env.X", "newline"),
    (replace(NANOTRON, env={"X": "$${HOME}"}), "env.X", "literal '${'"),
    (replace(NANOTRON, workdir="/w/$${X}"), "workdir", "literal '${'"),
])
def test_pyxis_errors(env, field, needle):
    with pytest.raises(ConfigError) as exc:
        to_pyxis_args(env)
    assert exc.value.field == field
    assert needle in one_line_error(exc)


# --------------------------------------------------------------------------
# base_environment
# --------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def edf_path(tmp_path, monkeypatch) -> Path:
    first, second = tmp_path / "edf one", tmp_path / "edf two"
    first.mkdir()
    monkeypatch.setenv("EDF_PATH", f"{first}:{second}")
    monkeypatch.chdir(tmp_path)
    return second


def test_resolve_base_merges_in_order(edf_path):
    write(edf_path / "common.toml", """
image = "/base.sqsh"
writable = false
workdir = "/base"
mounts = ["/a", "/shared"]
[env]
A = "1"
SHARED = "base"
[annotations]
com.hooks.cxi.enabled = "true"
""")
    write(edf_path.parent / "local" / "extra.toml", """
mounts = ["/x:/y:ro"]
entrypoint = true
[env]
SHARED = "extra"
""")
    child = Environment(image="/child.sqsh", mounts=[Mount("/shared", "/shared"), Mount("/b", "/b")],
                        env={"B": "2"}, annotations={"com.hooks.cxi.enabled": "false"},
                        base_environment=["common", "./local/extra.toml"])
    merged = resolve_base(child)
    assert merged == Environment(
        image="/child.sqsh", writable=False, workdir="/base", entrypoint=True,
        mounts=[Mount("/a", "/a"), Mount("/shared", "/shared"), Mount("/x", "/y", ("ro",)), Mount("/b", "/b")],
        env={"A": "1", "SHARED": "extra", "B": "2"}, annotations={"com.hooks.cxi.enabled": "false"},
    )
    assert list(merged.env) == ["A", "SHARED", "B"]
    # pyxis resolves the bases itself
    assert "--container-readonly" in to_pyxis_args(child).args


def test_resolve_base_paths_and_search(edf_path, tmp_path, monkeypatch):
    base = write(tmp_path / "abs dir" / "b.toml", 'image = "/abs.sqsh"\n')
    assert resolve_base(Environment(base_environment=[str(base)])).image == "/abs.sqsh"
    monkeypatch.setenv("BASEDIR", str(base.parent))
    assert resolve_base(Environment(base_environment=["${BASEDIR}/b.toml"])).image == "/abs.sqsh"
    # an explicit edf_path wins over $EDF_PATH; the default is ~/.edf
    write(tmp_path / "elsewhere" / "n.toml", 'image = "/else.sqsh"\n')
    assert resolve_base(Environment(base_environment=["n"]), edf_path=str(tmp_path / "elsewhere")).image \
        == "/else.sqsh"
    monkeypatch.delenv("EDF_PATH")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    write(tmp_path / "home" / ".edf" / "h.toml", 'image = "/home.sqsh"\n')
    assert find_edf("h") == tmp_path / "home" / ".edf" / "h.toml"
    assert resolve_base(Environment(base_environment=["h"])).image == "/home.sqsh"


def test_resolve_base_errors(edf_path, tmp_path):
    with pytest.raises(ConfigError) as exc:
        resolve_base(Environment(base_environment=["nope"]))
    assert exc.value.field == "base_environment[0]"
    assert "no EDF named 'nope'" in one_line_error(exc) and "edf one" in str(exc.value)

    write(edf_path / "a.toml", 'base_environment = "b"\n')
    write(edf_path / "b.toml", 'base_environment = ["a"]\n')
    with pytest.raises(ConfigError) as exc:
        resolve_base(Environment(base_environment=["a"]))
    assert "cycle a.toml -> b.toml -> a.toml" in one_line_error(exc)
    with pytest.raises(ConfigError) as exc:
        resolve_base(parse_edf(edf_path / "a.toml"))
    assert "cycle a.toml -> b.toml -> a.toml" in one_line_error(exc)
    write(edf_path / "self.toml", 'base_environment = "self"\n')
    with pytest.raises(ConfigError, match="cycle self.toml -> self.toml"):
        resolve_base(Environment(base_environment=["self"]))

    write(edf_path / "base.toml", '[env]\nA = "1"\n')
    with pytest.raises(ConfigError) as exc:
        resolve_base(Environment(base_environment=["base"], env={"B": "${A}/x"}, origin="container."))
    assert exc.value.field == "container.env.B"
    assert "refers to ${A}" in one_line_error(exc)

    with pytest.raises(ConfigError) as exc:
        resolve_base(Environment(base_environment=["${UNSET_FOR_TEST}/x.toml"]))
    assert "${UNSET_FOR_TEST} is not set" in one_line_error(exc)

    write(edf_path / "broken.toml", 'mounts = ["/a:/b:bogus"]\n')
    with pytest.raises(ConfigError) as exc:
        resolve_base(Environment(base_environment=["broken"]))
    assert exc.value.field == f"{edf_path / 'broken.toml'}:mounts[0]"


def test_resolve_base_depth_limit(edf_path):
    for i in range(12):
        write(edf_path / f"l{i}.toml", f'base_environment = "l{i + 1}"\n' if i < 11 else 'image = "/deep.sqsh"\n')
    assert resolve_base(Environment(base_environment=["l2"])).image == "/deep.sqsh"  # 10 levels
    with pytest.raises(ConfigError) as exc:
        resolve_base(Environment(base_environment=["l1"]))  # 11 levels
    assert "deeper than 10 levels" in one_line_error(exc)


# --------------------------------------------------------------------------
# Every rule has its error
# --------------------------------------------------------------------------


@pytest.mark.parametrize("text, field, needle", [
    ('imagee = "/x.sqsh"', "imagee", "valid keys: base_environment, image, workdir"),
    ('writable = "yes"', "writable", "expected true or false"),
    ("entrypoint = 1", "entrypoint", "expected true or false"),
    ('mounts = "/a"', "mounts", "expected an array"),
    ("mounts = [1]", "mounts[0]", "expected a string"),
    ("image = 3", "image", "expected a string"),
    ("workdir = true", "workdir", "expected a string"),
    ("base_environment = 3", "base_environment", "a string or an array"),
    ("base_environment = [3]", "base_environment[0]", "expected a string"),
    ("[env]\nX = 1", "env.X", "expected a string"),
    ('env = "X=1"', "env", "a table of strings"),
    ("[annotations]\ncom.hooks.cxi.enabled = true", "annotations.com.hooks.cxi.enabled", 'such as "true"'),
    ('mounts = ["/a:/b:rox"]', "mounts[0]", "mount flag 'rox' is not one of"),
    ('mounts = ["/a:/b:ro+sqsh"]', "mounts[0]", "must be the only flag"),
    ('mounts = ["/a:/b:ro+ro"]', "mounts[0]", "repeat a flag"),
    ('mounts = ["/a:/b:"]', "mounts[0]", "empty FLAGS"),
    ('mounts = ["/a:/b:/c:ro"]', "mounts[0]", "4 ':'-separated parts"),
    ('mounts = ["data:/data"]', "mounts[0]", "write './data'"),
    ('mounts = ["/data:data"]', "mounts[0]", "relative mount destination 'data' must start with ./"),
    ('mounts = ["../up:/up"]', "mounts[0]", "write './../up'"),
    ('mounts = ["~/x:/x"]', "mounts[0]", "${HOME}/x"),
    ('workdir = "work"', "workdir", "write './work'"),
    ('image = "images/x.sqsh"', "image", "pyxis #127"),
    ('image = "bad image"', "image", "whitespace"),
    ('base_environment = "envs/x.toml"', "base_environment[0]", "write './envs/x.toml'"),
    ('base_environment = "x.toml"', "base_environment[0]", "drop the .toml"),
    ('[env]\nA = "1"\nB = "${A}:2"', "env.B", "refers to ${A}, which is set in [env]"),
    ('[env]\nA = "${1A}"', "env.A", "not a valid expansion"),
    ('workdir = "/w/${X"', "workdir", "not a valid expansion"),
    ('[env]\n"1BAD" = "x"', "env.1BAD", "not a valid environment variable name"),
    ('[annotations]\na.b = "x"\n"a.b.c" = "y"', "annotations.a.b", "both a value and the table"),
    ('[annotations]\n"a..b" = "x"', "annotations.a..b", "not a valid annotation key"),
])
def test_bad_edf(text, field, needle):
    with pytest.raises(ConfigError) as exc:
        parse_edf(text)
    assert exc.value.field == field
    assert needle in one_line_error(exc)


def test_self_reference_and_literals_are_allowed():
    env = parse_edf('[env]\nPATH = "${PATH}:/custom/bin"\nPRICE = "$$5 $(x) $HOME"\n')
    assert env.env["PATH"] == "${PATH}:/custom/bin"


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError) as exc:
        parse_edf('image = "unterminated\n')
    assert "not valid TOML" in one_line_error(exc)
    with pytest.raises(ConfigError) as exc:
        parse_edf(tmp_path / "missing.toml")
    assert "no such EDF file" in one_line_error(exc)


def test_errors_from_the_config_name_container_fields():
    with pytest.raises(ConfigError) as exc:
        container(image="/i.sqsh", mounts=["/ok", "/a:/b:nosuchflag"])
    assert exc.value.field == "container.mounts[1]"
    one_line_error(exc)
    with pytest.raises(ConfigError) as exc:
        container(image="/i.sqsh", env={"A": "x", "B": "${A}"})
    assert exc.value.field == "container.env.B"
    with pytest.raises(ConfigError) as exc:
        container(image="/i.sqsh", workdir="rel")
    assert exc.value.field == "container.workdir"
    with pytest.raises(ConfigError) as exc:
        container(image="/i.sqsh", mount_home=True)
    assert exc.value.field == "container.mount_home" and "pyxis flag" in one_line_error(exc)
    with pytest.raises(ConfigError) as exc:
        container(edf_name="x/y")
    assert exc.value.field == "container.edf_name"
    assert container(runtime="none", workdir="rel").workdir == "rel"  # not used, so not checked


def test_check_edf_reports_every_problem(tmp_path, monkeypatch):
    path = write(tmp_path / "hand.toml", '\n'.join([
        'imagee = "/x.sqsh"', 'workdir = "work"', 'writable = "yes"',
        'mounts = ["/a:/b:rox", "/ok:/ok", "data:/data"]',
        '[env]', 'A = "1"', 'B = "${A}"', 'C = 3',
        '[annotations]', 'com.hooks.cxi.enabled = true', '']))
    env, problems = check_edf(path)
    fields = sorted(p.field for p in problems)
    assert fields == sorted([f"{path}:imagee", f"{path}:writable", f"{path}:mounts[0]", f"{path}:mounts[2]",
                      f"{path}:env.C", f"{path}:annotations.com.hooks.cxi.enabled", f"{path}:workdir",
                      f"{path}:env.B"]), fields
    assert env.mounts == [Mount("/ok", "/ok")]
    assert check_edf(write(tmp_path / "good.toml", 'image = "/x.sqsh"\n')) == (Environment(image="/x.sqsh"), [])
    _, problems = check_edf(write(tmp_path / "bad.toml", 'image = "x\n'))
    assert len(problems) == 1 and "not valid TOML" in str(problems[0])
    monkeypatch.setenv("EDF_PATH", str(tmp_path))
    _, problems = check_edf(write(tmp_path / "base.toml", 'base_environment = "nowhere"\n'))
    assert len(problems) == 1 and "no EDF named 'nowhere'" in str(problems[0])


def test_hostile_paths_with_newlines_are_refused():
    for env in (replace(NANOTRON, workdir="/a\nb"), replace(NANOTRON, mounts=[Mount("/a\nb", "/c")]),
                replace(NANOTRON, image="/a\nb.sqsh")):
        with pytest.raises(ConfigError) as exc:
            render_edf(env)
        assert "newline" in one_line_error(exc)


# --------------------------------------------------------------------------
# Writing files
# --------------------------------------------------------------------------


def test_write_edf_new_identical_different_force(tmp_path):
    target = tmp_path / "run dir" / "env.toml"
    assert write_edf(NANOTRON, target) == target
    assert target.read_text() == render_edf(NANOTRON)
    assert parse_edf(target) == NANOTRON
    assert parse_edf(str(target)) == NANOTRON

    os.utime(target, (1_000_000, 1_000_000))
    write_edf(NANOTRON, target)  # identical: a no-op
    assert target.stat().st_mtime == 1_000_000

    with pytest.raises(ConfigError) as exc:
        write_edf(HOSTILE, target)
    assert exc.value.field == str(target)
    assert "--force" in one_line_error(exc)
    assert target.read_text() == render_edf(NANOTRON)

    write_edf(HOSTILE, target, force=True)
    assert parse_edf(target) == HOSTILE
    assert os.listdir(target.parent) == ["env.toml"]


def test_write_edf_leaves_no_temp_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "env.toml"
    write_edf(NANOTRON, target)

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_edf(HOSTILE, target, force=True)
    assert os.listdir(tmp_path) == ["env.toml"]
    assert target.read_text() == render_edf(NANOTRON)


def test_write_edf_refuses_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        write_edf(NANOTRON, tmp_path)


def test_install_edf(tmp_path, monkeypatch):
    monkeypatch.setenv("EDF_PATH", f"{tmp_path / 'first'}:{tmp_path / 'second'}")
    path = install_edf(NANOTRON, "nanotron")
    assert path == tmp_path / "first" / "nanotron.toml"
    assert find_edf("nanotron") == path
    assert install_edf(NANOTRON, "nanotron") == path  # identical: fine
    with pytest.raises(ConfigError, match="--force"):
        install_edf(FULL, "nanotron")
    assert install_edf(FULL, "nanotron", force=True) == path
    assert install_edf(NANOTRON, "x", edf_path=str(tmp_path / "given")) == tmp_path / "given" / "x.toml"

    monkeypatch.delenv("EDF_PATH")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert install_edf(NANOTRON, "n") == tmp_path / "home" / ".edf" / "n.toml"

    for bad in ("../escape", "a b", "x.toml", ""):
        with pytest.raises(ConfigError) as exc:
            install_edf(NANOTRON, bad)
        assert "not a safe EDF name" in one_line_error(exc)
    monkeypatch.setenv("EDF_PATH", "relative/dir")
    with pytest.raises(ConfigError, match="not absolute"):
        install_edf(NANOTRON, "n")
