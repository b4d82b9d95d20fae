"""The wheels `slipway gpu-check` needs on a node without network, beside the node's own torch,
gathered where an index is reachable (`make gpu-check-wheels`; what goes in and how the node
installs them: docs/trainer.md). torch is the node's, and so is whatever `--have` lists: each is
stood in for by an empty wheel of its version while pip resolves, so neither it nor what only it
needs is fetched. The directory appears whole or not at all, and is refused past MAX_BYTES (what a
node's scratch and a copy over a slow link bear).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path
from typing import Optional

from common.errors import ConfigError
from common.fs import write_atomic

MAX_BYTES = 60 * 2**20
LEFT_OUT = ("torch", "datasets")  # of the trainer extra: the node's own torch; the shipped corpus needs no datasets
MARK = ".slipway-wheels"
# What slipway's wheel is built from (pyproject.toml's packages, readme and license).
PACKAGED = ("pyproject.toml", "README.md", "LICENSE", "common", "jobs", "edf", "containers", "trainer")
ROOT = Path(__file__).resolve().parents[2]


def platform_tags(platform: str) -> list[str]:
    """`manylinux_2_28_x86_64` and every older manylinux tag a glibc 2.28 machine runs (pip takes
    --platform literally); pure-Python wheels fit any."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(x86_64|aarch64)", platform)
    if not m:
        raise ConfigError("--platform", f"{platform!r}: give manylinux_2_N_ARCH (N the node's glibc minor, "
                                        "`ldd --version` says it; ARCH x86_64 or aarch64), e.g. manylinux_2_28_x86_64")
    glibc, arch = int(m[1]), m[2]
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 16, -1)]
    return tags + [f"manylinux{alias}_{arch}" for alias, minor in (("2014", 17), ("2010", 12), ("1", 5))
                   if minor <= glibc and (alias == "2014" or arch == "x86_64")]


def stub_wheel(directory: Path, name: str, version: str) -> None:
    """An empty wheel of `name` at `version`+slipway: what the node has, for pip's resolver."""
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: slipway\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(directory / f"{dist}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def node_has(path: Optional[Path]) -> dict[str, str]:
    """NAME==VERSION lines of `pip list --format=freeze` (pip freeze's too); torch always, at a
    version in slipway's range where the list does not say."""
    have = {"torch": "2.13.0"}
    if path is None:
        return have
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("--have", f"{path}: {exc.strerror}") from None
    for line in text.splitlines():
        if m := re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][^\s;#]*)\s*", line):
            have[_norm(m[1])] = m[2].split("+")[0]
    return have


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    """slipway pinned to its version, and pyproject.toml's trainer extra (its wheel's) less LEFT_OUT."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [f"slipway=={project['version']}", *(req for req in project["optional-dependencies"]["trainer"]
                                                 if _norm(re.match(r"[A-Za-z0-9._-]+", req)[0]) not in LEFT_OUT)]


def gather(out: Path, python_version: str, platform: str, have: Optional[Path] = None, say=print) -> int:
    """Fill `out` with the wheels; its size in bytes."""
    if not re.fullmatch(r"3\.\d+", python_version):
        raise ConfigError("--python-version", f"{python_version!r}: give the node's Python as 3.N, e.g. 3.12")
    tags = platform_tags(platform)
    if out.exists() and any(out.iterdir()) and not (out / MARK).is_file():
        raise ConfigError("--out", f"{out} holds other files: give a new or empty directory (or an earlier bundle, "
                                   "which is replaced)")
    if not (ROOT / "pyproject.toml").is_file():
        raise ConfigError("gpu-check-wheels", f"{ROOT} is no checkout of slipway (no pyproject.toml): run it there")
    target = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
              *(a for tag in tags for a in ("--platform", tag))]
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        wheels = work / "wheels"
        _own_wheel(work, wheels)
        reqs = requirements()
        nodes = node_has(have)
        say(f"resolving {', '.join(reqs)} for CPython {python_version} on {platform} (the node has: "
            f"{', '.join(sorted(nodes))})")
        abi = ["--abi", f"cp{python_version.replace('.', '')}", "--abi", "abi3", "--abi", "none"]
        if chosen := _resolve(work, [*target, *abi], reqs, nodes):
            _pip(["download", "-q", "--no-deps", *target, "-d", str(wheels), *chosen], "downloading")
        size = _within_limit(wheels)
        write_atomic(wheels / "requirements.txt",
                     f"# slipway gpu-check for CPython {python_version} on {platform}, beside the node's torch\n"
                     + "".join(f"{r}\n" for r in reqs))
        (wheels / MARK).write_text(json.dumps({"python": python_version, "platform": platform, "bytes": size}) + "\n")
        if out.exists():
            os.replace(out, work / "old")
        os.replace(wheels, out)
        say(f"{out}: {len(list(out.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB (at most {MAX_BYTES // 2**20}); on the "
            f"node, from this checkout: make gpu-check WHEELS={shlex.quote(str(out))} OUT=report")
        return size
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _own_wheel(work: Path, wheels: Path) -> None:
    """slipway's wheel, from a copy of what pyproject.toml packages (a checkout's build/ may be stale)."""
    source = work / "source"
    source.mkdir()
    for name in PACKAGED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, source / name)
    _pip(["wheel", "--no-deps", "-q", "-w", str(wheels), str(source)], "building slipway's wheel")


def _resolve(work: Path, target: list[str], reqs: list[str], nodes: dict[str, str]) -> list[str]:
    """NAME==VERSION of every wheel `reqs` need for the node that it does not have (stood in for by
    empty wheels while pip resolves), slipway's own left out."""
    stubs = work / "stubs"
    stubs.mkdir()
    for name, version in nodes.items():
        stub_wheel(stubs, name, f"{version}+slipway")
    (work / "constraints.txt").write_text("".join(f"{n}=={v}+slipway\n" for n, v in nodes.items()))
    _pip(["install", "-q", "--dry-run", "--ignore-installed", "--report", str(work / "report.json"),
                "--target", str(work / "target"), *target, "--find-links", str(stubs), "--find-links",
                str(work / "wheels"), "-c", str(work / "constraints.txt"), *reqs], "resolving")
    return [f"{i['metadata']['name']}=={i['metadata']['version']}"
            for i in json.loads((work / "report.json").read_text())["install"]
            if _norm(i["metadata"]["name"]) not in nodes and _norm(i["metadata"]["name"]) != "slipway"]


def _within_limit(wheels: Path) -> int:
    """The wheels' size in bytes, refused past MAX_BYTES."""
    size = sum(p.stat().st_size for p in wheels.iterdir())
    if size > MAX_BYTES:
        biggest = sorted(wheels.iterdir(), key=lambda p: p.stat().st_size, reverse=True)[:4]
        largest = ", ".join(f"{p.name.split('-')[0]} {p.stat().st_size / 2**20:.1f}" for p in biggest)
        raise ConfigError("gpu-check-wheels", f"{size / 2**20:.1f} MiB of wheels, over the {MAX_BYTES // 2**20} MiB "
                                              f"this bundle may take (largest, MiB: {largest}): give --have the "
                                              "node's `python3 -m pip list --format=freeze` to leave out what it "
                                              "has")
    return size


def _pip(args: list[str], what: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines()
                 if ln.strip() and "is ignored: it is neither a file nor a directory" not in ln]
        error = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "no output")
        raise ConfigError("gpu-check-wheels", f"{what} failed (pip exit {proc.returncode}): {error[:400]}")


def main(argv: Optional[list[str]] = None) -> int:
    from common.edge import Parser, run_at_edge

    parser = Parser(prog="python -m jobs.gpucheck.wheels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the directory of wheels (made whole, or replaced)")
    parser.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        help="the node's Python, 3.N (default: this one's)")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64", help="manylinux_2_N_ARCH of the node")
    parser.add_argument("--have", type=Path, help="the node's `python3 -m pip list --format=freeze`: left out")
    args = parser.parse_args(argv)
    return run_at_edge(lambda: gather(args.out.absolute(), args.python_version, args.platform, args.have) and 0)


if __name__ == "__main__":
    sys.exit(main())
