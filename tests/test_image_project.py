"""Images belong to a project, and are rebuilt only where they changed.

- A checkout's identity (containers/project.py): kept across a move, new for a copy, one for
  concurrent first uses; damaged state is one line.
- `slipway image prune`, `image containers` and a job's kept-builds bound act on this project's
  labelled images and containers alone, never on another project's, an unlabelled one or an
  import that runs now (its lock); `--dry-run` removes nothing; what is kept is said with why.
- A change of what only the import reads (squash options, output directory) imports the podman
  image built already, running no Dockerfile step; a touched but unchanged wheelhouse keeps the
  layer cache; `slipway image build --dry-run` says which steps would run.

The fast tests use the podman/enroot stand-ins (tests/image_standins.py). The `podman` tests
run the real podman on the machine's storage, through the command line, with a tiny base made
from this machine's /bin/sh, a repository name of their own and two projects sharing it; they
act on, and clean up, only the images they labelled or made themselves.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from plumbum import local

from containers.image import build_image, image_plan
from containers.project import Project
from containers.prune import prune_images
from containers.record import BuildRecord, ImageSection
from containers.tools import Enroot, Podman
from common.errors import ConfigError
from jobs.config import Config
from image_standins import calls, tiny_base, write_standins
from test_image import copy_sources
from test_job_lib import Lib

PY = sys.executable


def slipway(cwd: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "400", **(env or {})})


def checkout(where: Path) -> Path:
    """A checkout of slipway's image sources (its own code runs `python -m jobs` there)."""
    return copy_sources(where)


# ---------------------------------------------------------------- a project's identity


def _of(root: str) -> str:
    return Project.of(Path(root)).id


def test_a_checkout_keeps_its_id_when_moved_and_a_copy_gets_its_own(tmp_path: Path):
    a = tmp_path / "a"
    a.mkdir()
    first = Project.of(a)
    assert re.fullmatch(r"[0-9a-f]{32}", first.id) and first.token == f"p{first.id[:12]}"
    assert Project.of(a) == first and json.loads(first.file.read_text())["root"] == str(a)
    # Seen through a symbolic link: the same checkout, the same id, and the record is not rewritten.
    (tmp_path / "link").symlink_to(a)
    assert Project.of(tmp_path / "link").id == first.id
    # A copy (the original still there, holding the same id) is another project.
    shutil.copytree(a, tmp_path / "copy")
    copy = Project.of(tmp_path / "copy")
    assert copy.id != first.id and Project.of(a).id == first.id and Project.of(tmp_path / "copy") == copy
    # Moved (the original place no longer holds it): the same project.
    a.rename(tmp_path / "moved")
    assert Project.of(tmp_path / "moved").id == first.id
    assert json.loads((tmp_path / "moved" / ".slipway" / "project").read_text())["root"] == str(tmp_path / "moved")


def test_concurrent_first_uses_agree_on_one_id(tmp_path: Path):
    root = tmp_path / "proj"
    root.mkdir()
    with multiprocessing.get_context("spawn").Pool(6) as pool:
        ids = pool.map(_of, [str(root)] * 12)
    assert len(set(ids)) == 1 and Project.of(root).id == ids[0]


def test_damaged_or_blocked_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "proj"
    (root / ".slipway").mkdir(parents=True)
    (root / ".slipway" / "project").write_text("{not json")
    fresh = Project.of(root)  # damaged: a new id (images labelled with the old one are then another's)
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.id) and Project.of(root) == fresh
    # A checkout that cannot hold it: the user's state directory does, by the checkout's path.
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / ".slipway").write_text("a file where the state directory goes")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    kept = Project.of(blocked)
    assert kept.state.parent == tmp_path / "state" / "slipway" / "projects" and Project.of(blocked) == kept
    assert kept.lock_path("localhost/x:1").parent == kept.state / "locks"
    # Neither can: one line naming both and the fix.
    (tmp_path / "state2").write_text("not a directory")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state2"))
    with pytest.raises(ConfigError) as exc:
        Project.of(blocked)
    text = str(exc.value)
    assert text.startswith(f"image: cannot record this project's identity ({blocked / '.slipway' / 'project'}: ")
    assert "make the checkout or XDG_STATE_HOME writable" in text and "\n" not in text


def test_without_flock_a_build_goes_on_and_prune_keeps_what_it_cannot_tell(tmp_path: Path, monkeypatch, fakes: Path):
    """A filesystem without flock(2) (Lustre without -o flock): a build goes on unguarded, and prune
    keeps the tags and containers whose build it cannot tell apart from a running one."""
    import errno
    import fcntl

    root = checkout(tmp_path / "a")
    cfg = cfg_of()
    (root / "configs" / "v.yaml").write_text("run: {seed: 1}\n")
    old = build_image(cfg, root=root)
    (root / "configs" / "v.yaml").unlink()
    build_image(cfg, root=root)

    def no_flock(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with Project.of(root).building(old.plan.tag) as guarded:
        assert guarded is None  # no flock: nothing tells prune that this build runs
    result = prune_images(cfg, pinned={}, root=root, console=quiet())
    assert result.ok and old.plan.tag not in result.tags and not old.squashfs.exists()
    assert result.kept_tags[old.plan.tag].startswith("whether a build of it runs cannot be told (")
    assert old.plan.tag in standin(fakes, "images").split()


def test_old_build_records_read_without_a_project():
    base = {"name": "slipway", "hash": "ab" * 32, "tag": "localhost/slipway:abababababab", "squashfs": "/x.sqsh"}
    assert BuildRecord.from_json(base).project is None
    assert BuildRecord.from_json({**base, "project": 5}).project is None  # damaged: not taken for one
    assert BuildRecord.from_json({**base, "project": "f" * 32}).project == "f" * 32


# ---------------------------------------------------------------- prune: this project's only (stand-ins)


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """podman and enroot stand-ins first on PATH: one storage for every project of the test."""
    bin_dir = write_standins(tmp_path / "bin", "podman", "enroot")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("FAKE_ENROOT_MODE", raising=False)
    monkeypatch.setenv("ENROOT_TEMP_PATH", str(tmp_path))
    return bin_dir


def cfg_of(**image) -> Config:
    cfg = Config()
    cfg.image = ImageSection(**{"base_image": "localhost/base:1", "flash_attn": False, **image})
    return cfg


def standin(bin_dir: Path, *args: str) -> str:
    return subprocess.run([str(bin_dir / "podman"), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_prune_acts_on_this_projects_images_alone(tmp_path: Path, fakes: Path):
    """Two projects with the default image name in one podman storage, and an unlabelled tag:
    A's prune removes A's old build alone, its dry run nothing."""
    a, b = checkout(tmp_path / "a"), checkout(tmp_path / "b")
    cfg = cfg_of()
    (a / "configs" / "v.yaml").write_text("run: {seed: 1}\n")
    a_old = build_image(cfg, root=a)
    (a / "configs" / "v.yaml").unlink()
    a_new, b_cur = build_image(cfg, root=a), build_image(cfg, root=b)
    assert a_new.plan.hash == b_cur.plan.hash and a_new.plan.tag != b_cur.plan.tag  # same sources, two projects
    (b / "configs" / "v.yaml").write_text("run: {seed: 2}\n")
    b_old = build_image(cfg, root=b)
    (b / "configs" / "v.yaml").unlink()
    build_image(cfg, root=b)  # B's current again: its older build is B's to prune, not A's
    standin(fakes, "build", "-t", "localhost/slipway:handmade", str(tmp_path))  # no project label
    # B's import container, made from B's image: another project's.
    standin(fakes, "create", "--name", "enroot.Bimport001", b_old.plan.tag)
    tags = standin(fakes, "images").split()
    n = len(calls(fakes, "podman"))

    dry = prune_images(cfg, pinned={}, root=a, dry_run=True, console=quiet())
    assert dry.tags == [a_old.plan.tag] and dry.removed[:1] == [a_old.squashfs] and dry.ok
    assert standin(fakes, "images").split() == tags and a_old.squashfs.exists()  # nothing removed
    assert not [c for c in calls(fakes, "podman")[n:] if c["argv"][1] in ("rmi", "rm")]
    assert any(line.startswith("left alone 2 podman tags of localhost/slipway that are another project's")
               for line in dry.left_alone), dry.left_alone
    assert any(line.startswith("left alone 1 podman tags of localhost/slipway with no project label")
               and "localhost/slipway:handmade" in line for line in dry.left_alone)
    assert any("enroot.Bimport001" in line for line in dry.left_alone)

    done = prune_images(cfg, pinned={}, root=a, console=quiet())
    assert done.ok and done.tags == [a_old.plan.tag] and not a_old.squashfs.exists()
    assert done.kept_tags == {a_new.plan.tag: f"the tag of {a_new.squashfs.name}, kept"}
    left = standin(fakes, "images").split()
    assert sorted(left) == sorted(set(tags) - {a_old.plan.tag})
    assert {b_cur.plan.tag, b_old.plan.tag, "localhost/slipway:handmade"} <= set(left)
    assert b_old.squashfs.exists() and b_cur.squashfs.exists()
    assert [json.loads(p.read_text())["Names"] for p in (fakes / "state").glob("ctr-*.json")] == [["enroot.Bimport001"]]


def test_a_squashfs_another_project_recorded_stays_in_a_shared_output_dir(tmp_path: Path, fakes: Path):
    shared = tmp_path / "scratch-images"
    a, b = checkout(tmp_path / "a"), checkout(tmp_path / "b")
    cfg = cfg_of(output_dir=str(shared))
    (b / "configs" / "v.yaml").write_text("run: {seed: 3}\n")
    b_build = build_image(cfg, root=b)
    a_build = build_image(cfg, root=a)  # now the current one of that directory
    result = prune_images(cfg, pinned={}, root=a, console=quiet())
    assert result.ok and b_build.squashfs.exists() and a_build.squashfs.exists()
    assert result.left_alone[0] == (f"left alone 1 squashfs files in {shared} that are not this project's (their "
                                    "records name another project) or whose project is not known: "
                                    f"{b_build.squashfs.name} (another project's)")
    # A record from before records named a project, outside the checkout: not known, left alone.
    record = json.loads(b_build.squashfs.with_suffix(".json").read_text())
    record.pop("project")
    b_build.squashfs.with_suffix(".json").write_text(json.dumps(record))
    again = prune_images(cfg, pinned={}, root=a, console=quiet())
    assert b_build.squashfs.exists() and "(with no project in its record, outside this checkout)" in again.left_alone[0]


def test_dry_runs_through_the_command_line(tmp_path: Path, fakes: Path):
    a = checkout(tmp_path / "a")
    args = ["configs/tiny_cpu.yaml", "image.base_image=localhost/base:1", "image.flash_attn=false"]
    r = slipway(a, "image", "build", *args, "--dry-run")
    assert r.returncode == 0, r.stderr
    plan = image_plan(cfg_of(), root=a, enroot_mount=False)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("would run, for slipway-") and lines[1].startswith("  podman build localhost/slipway:")
    assert "podman does not have it" in lines[1] and lines[2].startswith("  enroot import -> ")
    assert not (a / "images").exists() or not list((a / "images").glob("*.sqsh"))
    assert slipway(a, "image", "build", *args).returncode == 0
    r = slipway(a, "image", "build", *args, "--dry-run")
    assert r.stdout.startswith("nothing to run: ") and "exists" in r.stdout, r.stdout
    r = slipway(a, "image", "build", *args, "image.squash_options=-comp lz4", "--dry-run")
    assert "  no podman build: podman has localhost/slipway:" in r.stdout, r.stdout
    assert "  enroot import -> " in r.stdout
    r = slipway(a, "image", "show", *args)
    assert f"project   {Project.of(a).id} ({a / '.slipway' / 'project'})" in r.stdout, r.stdout
    assert plan.project == Project.of(a)
    n = len(calls(fakes, "podman"))
    r = slipway(a, "image", "prune", *args, "--keep", "1", "--dry-run")
    assert r.returncode == 0 and "nothing to prune" in r.stdout, r.stdout
    assert not [c for c in calls(fakes, "podman")[n:] if c["argv"][1] in ("rmi", "rm")]


# ---------------------------------------------------------------- kept pyxis containers on a node


def _enroot_data(lib: Lib, data: Path) -> None:
    data.mkdir(parents=True, exist_ok=True)
    lib.stand_in("enroot", f'export ENROOT_DATA_PATH="${{ENROOT_DATA_PATH:-{data}}}"\n'
                           "# ----- END CONFIG -----\n"
                           'case "$1" in list) ls -1 "$ENROOT_DATA_PATH" ;; '
                           'remove) sleep 0.2; rm -rf "${ENROOT_DATA_PATH:?}/$3" ;; esac')


def test_the_kept_builds_bound_acts_on_this_projects_containers_alone(tmp_path: Path):
    """A job's sweep (CONTAINER_PREFIX slipway-pA-) bounds this project's kept builds and removes
    its ended attempts, never another project's (slipway-pB-) nor those named before names
    carried a project; listing says those left alone."""
    mine, theirs = "slipway-paaaaaaaaaaaa-", "slipway-pbbbbbbbbbbbb-"
    lib = Lib(tmp_path, prefix=mine, build="inew")  # KEEP_BUILDS=2
    data = tmp_path / "enroot-data"
    _enroot_data(lib, data)
    names = [f"pyxis_{mine}iold", f"pyxis_{mine}iolder", f"pyxis_{mine}30", f"pyxis_{theirs}iold",
             f"pyxis_{theirs}31", "pyxis_slipway-iold", "pyxis_slipway-32"]
    for name in names:
        (data / name / "usr").mkdir(parents=True)
    (data / ".slipway").mkdir()
    for i, name in enumerate((f"pyxis_{mine}iolder", f"pyxis_{mine}iold", f"pyxis_{theirs}iold")):
        (data / ".slipway" / name).write_text("12\n")
        os.utime(data / ".slipway" / name, (1000 + i, 1000 + i))
    lib.stand_in("squeue", "exit 1")  # every job is over
    listed = lib.run(f"sweep_containers '' '' '' 0 list {mine}")
    assert sorted(listed.stdout.splitlines()) == sorted([
        f"would remove pyxis_{mine}30", f"would remove pyxis_{mine}iold", f"would remove pyxis_{mine}iolder",
        f"left alone pyxis_{theirs}iold: not this project's", f"left alone pyxis_{theirs}31: not this project's",
        "left alone pyxis_slipway-iold: not this project's", "left alone pyxis_slipway-32: not this project's"]), \
        listed.stdout + listed.stderr
    assert sorted(p.name for p in data.iterdir()) == sorted([".slipway", *names])  # a list removes nothing
    # The job's own sweep, in the background as the batch script starts it, with its prefix.
    lib.stand_in("srun", 'while [ "${1#--}" != "$1" ]; do shift; done; "$@"')  # the per-node script here, as one node
    r = lib.run('remove_stale_containers; wait "${HELPER_PIDS[@]}"')
    assert r.returncode == 0, r.stderr
    left = sorted(p.name for p in data.iterdir() if not p.name.startswith("."))
    # This job's build and the most recently used other (iold) are the 2 kept; iolder and the ended attempt go.
    assert left == sorted([f"pyxis_{mine}iold", f"pyxis_{theirs}iold", f"pyxis_{theirs}31", "pyxis_slipway-iold",
                           "pyxis_slipway-32"]), left


def test_image_containers_prints_each_line_as_it_comes_and_says_it_is_alive(tmp_path: Path, monkeypatch):
    """`slipway image containers --remove` through a stand-in srun that runs the node's script here:
    this project's prefix is passed, lines arrive while the removal runs (not at its end), and a
    silent stretch is said."""
    from jobs.cli import image as cli

    a = checkout(tmp_path / "a")
    monkeypatch.chdir(a)
    monkeypatch.setenv("SLIPWAY_PROJECT", str(a))
    monkeypatch.setattr(cli, "QUIET_S", 0.5)
    bin_dir = tmp_path / "bin"
    write_standins(bin_dir, "srun")
    data = tmp_path / "enroot-data"
    token = Project.of(a).token
    for name in (f"pyxis_slipway-{token}-iold", "pyxis_slipway-pbbbbbbbbbbbb-iold"):
        (data / name / "usr").mkdir(parents=True)
    (bin_dir / "enroot").write_text(f'#!/bin/bash\nexport ENROOT_DATA_PATH={data}\n# ----- END CONFIG -----\n'
                                    'case "$1" in list) ls -1 "$ENROOT_DATA_PATH" ;; '
                                    'remove) sleep 1.5; rm -rf "${ENROOT_DATA_PATH:?}/$3" ;; esac\n')
    (bin_dir / "enroot").chmod(0o755)
    (bin_dir / "squeue").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    (data / ".slipway").mkdir()
    monkeypatch.setattr("jobs.slurm.hostnames", lambda nodes: nodes.split(","))
    seen: list[tuple[float, str]] = []

    class Console:
        def print(self, text, **_):
            seen.append((time.monotonic(), str(text)))

    t0 = time.monotonic()
    assert cli.containers(cfg_of(), nodes="node7", remove=True, console=Console()) == 0
    lines = [text for _, text in seen]
    assert f"node7: removed pyxis_slipway-{token}-iold" in lines, lines
    assert f"node7: deleting the files of pyxis_slipway-{token}-iold" in lines
    assert any(re.fullmatch(rf"node7: deleted the files of pyxis_slipway-{token}-iold in \d+ s", line)
               for line in lines), lines
    assert any(line.startswith("still removing on node7 (") for line in lines), lines
    deleting = next(t for t, text in seen if "deleting the files" in text)
    assert deleting - t0 < seen[-1][0] - t0 - 1.0  # said before the deleting ended, not with the end
    assert (data / "pyxis_slipway-pbbbbbbbbbbbb-iold").is_dir() and not (data / f"pyxis_slipway-{token}-iold").exists()
    # One node that cannot tell (no enroot there) must not cut the others' answers short: under
    # KillOnBadExit=1, as the local cluster and many sites have it, srun would kill their tasks.
    assert "--kill-on-bad-exit=0" in calls(bin_dir, "srun")[-1]["argv"]
    # No --nodes, and no node of the partition answers: one line naming the flag, no srun started.
    (bin_dir / "sinfo").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sinfo").chmod(0o755)
    runs_before = len(calls(bin_dir, "srun"))
    with local.env(PATH=os.environ["PATH"]), pytest.raises(  # plumbum's copy of PATH: the stand-ins first
            ConfigError, match=r"^--nodes: no responding node in partition \(any\): name the nodes with --nodes NODELIST$"):
        cli.containers(cfg_of(), nodes=None, remove=False, console=Console())
    assert len(calls(bin_dir, "srun")) == runs_before


def quiet():
    from rich.console import Console

    return Console(quiet=True)


# ---------------------------------------------------------------- real podman: one storage, two projects

TINY_DOCKERFILE = """ARG BASE_IMAGE
FROM ${BASE_IMAGE}
ARG WHEELHOUSE_DIGEST=""
RUN --mount=type=bind,source=wheels,target=/tmp/wheels for w in /tmp/wheels/*; do echo "deps step: $w"; done
COPY src/pyproject.toml /opt/pyproject.toml
ARG SMOKE=""
RUN echo "smoke ok $SMOKE"
CMD ["/bin/sh"]
"""


class Real:
    """A repository name of this run's own in the machine's podman storage, a tiny base, a
    logging wrapper first on PATH before the real podman, and enroot's import (the stand-in's
    real mode: podman create + export + mksquashfs, as upstream enroot does)."""

    def __init__(self, work: Path):
        self.name = f"slipway-ptest-{uuid.uuid4().hex[:8]}"
        self.base = tiny_base()
        self.work = work
        self.bin = work / "bin"
        write_standins(self.bin, "enroot")
        self.log = work / "podman-calls.log"
        real = shutil.which("podman")
        (self.bin / "podman").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {self.log}\nexec {real} "$@"\n')
        (self.bin / "podman").chmod(0o755)
        self.env = {"PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}", "FAKE_ENROOT_MODE": "real",
                    "ENROOT_TEMP_PATH": str(work)}

    def project(self, where: str) -> Path:
        root = checkout(self.work / where)
        (root / "containers" / "Dockerfile.tiny").write_text(TINY_DOCKERFILE)
        return root

    def args(self, *overrides: str) -> list[str]:
        return ["configs/tiny_cpu.yaml", "image.dockerfile=containers/Dockerfile.tiny", f"image.base_image={self.base}",
                "image.flash_attn=false", "image.isolation=chroot", f"image.name={self.name}", *overrides]

    def slipway(self, root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return slipway(root, *args, env={**self.env, **(env or {})})

    def build(self, root: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
        r = self.slipway(root, "image", "build", *self.args(*overrides), env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        return r

    def current(self, root: Path) -> BuildRecord:
        return BuildRecord.read(root / "images" / f"{self.name}.json")

    def podman_calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def exists(self, tag: str) -> bool:
        return subprocess.run(["podman", "image", "exists", tag]).returncode == 0

    def clean(self) -> None:
        """What this run made: every tag of its own repository, and the containers made from them."""
        podman = Podman.find()
        for c in podman.containers(Enroot.CONTAINER_FILTER):
            if c.image.startswith(f"localhost/{self.name}:"):
                podman.remove_container(c.id)
        for tag in podman.tags(f"localhost/{self.name}"):
            podman.untag(tag)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from test_image import _podman_ok

    reason = _podman_ok()
    if reason:
        pytest.skip(reason)
    made = Real(tmp_path_factory.mktemp("real-podman"))
    try:
        yield made
    finally:
        made.clean()


@pytest.mark.podman
def test_real_two_projects_share_one_podman_storage_and_prune_their_own(real: Real):
    a, b = real.project("a"), real.project("b")
    (a / "configs" / "v.yaml").write_text("run: {seed: 1}\n")
    real.build(a)
    a_old = real.current(a)
    (a / "configs" / "v.yaml").unlink()
    real.build(a)
    a_new = real.current(a)
    real.build(b)
    b_cur = real.current(b)
    assert a_new.hash == b_cur.hash and a_new.tag != b_cur.tag and a_new.project == Project.of(a).id
    unlabelled = f"localhost/{real.name}:unlabelled"
    subprocess.run(["podman", "tag", real.base, unlabelled], check=True)  # made here, no project label
    everything = (a_old.tag, a_new.tag, b_cur.tag, unlabelled)
    assert all(real.exists(t) for t in everything)

    dry = real.slipway(a, "image", "prune", *real.args(), "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    out = dry.stdout.splitlines()
    assert f"would remove podman tag {a_old.tag}" in out and f"would remove {a_old.squashfs} (" in dry.stdout
    assert f"kept podman tag {a_new.tag}: the tag of {Path(a_new.squashfs).name}, kept" in out
    assert f"left alone 1 podman tags of localhost/{real.name} that are another project's: {b_cur.tag} ({b})" in out
    assert any(line.startswith(f"left alone 1 podman tags of localhost/{real.name} with no project label") and
               line.endswith(f": {unlabelled}") for line in out), out
    assert out[-1].startswith("dry run: nothing was removed")
    assert all(real.exists(t) for t in everything) and Path(a_old.squashfs).exists()

    done = real.slipway(a, "image", "prune", *real.args())
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"removed podman tag {a_old.tag}" in done.stdout.splitlines()
    assert not real.exists(a_old.tag) and not Path(a_old.squashfs).exists()
    assert real.exists(a_new.tag) and real.exists(b_cur.tag) and real.exists(unlabelled)
    # B's prune: A's images are another project's to B.
    r = real.slipway(b, "image", "prune", *real.args())
    assert r.returncode == 0 and real.exists(a_new.tag) and real.exists(b_cur.tag), r.stdout + r.stderr
    assert f"that are another project's: {a_new.tag} ({a})" in r.stdout


@pytest.mark.podman
def test_real_prune_racing_an_import_leaves_it_alone(real: Real):
    c = real.project("c")
    real.build(c)
    go = real.work / "import-may-end"
    variant = ["image.build_args.SMOKE=variant"]  # another image of this project, not current, not pinned
    proc = subprocess.Popen([PY, "-m", "jobs", "image", "build", *real.args(*variant)], cwd=c, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, **real.env, "FAKE_ENROOT_WAIT": str(go), "COLUMNS": "400"})
    try:
        project = Project.of(c)
        deadline, importing = time.monotonic() + 300, []
        while not importing and time.monotonic() < deadline and proc.poll() is None:
            importing = [ctr for ctr in Podman.find().containers(Enroot.CONTAINER_FILTER)
                         if ctr.labels.get("slipway.project") == project.id]
            time.sleep(0.2)
        assert importing, proc.communicate()[0] if proc.poll() is not None else "no import started"
        (ctr,) = importing
        r = real.slipway(c, "image", "prune", *real.args())
        assert r.returncode == 0, r.stdout + r.stderr
        assert (f"kept podman container {ctr.name} (left by enroot import of {ctr.image}): a build or import of it "
                "is running now") in r.stdout.splitlines()
        assert f"kept podman tag {ctr.image}: a build or import of it is running now" in r.stdout.splitlines()
        assert real.exists(ctr.image)
    finally:
        go.touch()
        output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    assert "image ready" in output and Path(real.current(c).squashfs).is_file()


def _step_lines(output: str, mark: str) -> list[str]:
    return [line for line in output.splitlines() if line.lstrip().startswith("STEP ") and mark in line]


@pytest.mark.podman
def test_real_import_only_changes_run_no_dockerfile_step(real: Real, tmp_path: Path):
    d = real.project("d")
    real.build(d)
    first = real.current(d)
    n = len(real.podman_calls())
    dry = real.slipway(d, "image", "build", *real.args("image.squash_options=-comp gzip"), "--dry-run")
    assert f"  no podman build: podman has {first.tag}, built from the same Dockerfile, build args and files" \
        in dry.stdout.splitlines(), dry.stdout
    r = real.build(d, "image.squash_options=-comp gzip")
    assert f"podman image {first.tag} exists: not rebuilding (only the import's settings differ)" in r.stdout
    gzip = real.current(d)
    assert gzip.tag == first.tag and gzip.squashfs != first.squashfs and Path(first.squashfs).exists()
    assert "Compression gzip" in subprocess.run(["unsquashfs", "-s", gzip.squashfs], capture_output=True,
                                                text=True).stdout
    elsewhere = tmp_path / "other-images"
    r = real.build(d, f"image.output_dir={elsewhere}")
    assert "not rebuilding" in r.stdout and list(elsewhere.glob(f"{real.name}-*.sqsh"))
    assert not [call for call in real.podman_calls()[n:] if call.startswith("build")]


@pytest.mark.podman
def test_real_a_touched_but_unchanged_wheelhouse_keeps_the_layer_cache(real: Real, tmp_path: Path):
    e = real.project("e")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "x-1.0-py3-none-any.whl"
    wheel.write_text(uuid.uuid4().hex)  # this run's own: the first build runs the step
    r = real.build(e, f"image.wheelhouse={wheels}")
    (deps,) = _step_lines(r.stdout, "/tmp/wheels")
    assert not deps.endswith("(cached)"), r.stdout
    # Touched (new timestamps, the same bytes), and a source changed so that podman builds again.
    later = time.time() + 100
    os.utime(wheel, (later, later))
    os.utime(wheels, (later, later))
    (e / "configs" / "extra.yaml").write_text("run: {}\n")
    r = real.build(e, f"image.wheelhouse={wheels}")
    (deps,) = _step_lines(r.stdout, "/tmp/wheels")
    assert "podman build" in r.stdout and deps.endswith("(cached)"), r.stdout
    # New bytes: the step runs again.
    wheel.write_text(uuid.uuid4().hex)
    r = real.build(e, f"image.wheelhouse={wheels}")
    (deps,) = _step_lines(r.stdout, "/tmp/wheels")
    assert not deps.endswith("(cached)"), r.stdout
