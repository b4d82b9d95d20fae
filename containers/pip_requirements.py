"""What pip installs into the image besides slipway itself, and the install.

Runs inside the image build (stdlib only, any Python >= 3.8) and on the host (the tests
compute the wheelhouse from it): slipway's runtime dependencies, its `trainer` and `plot`
extras (the batch script draws the run's curves in the image), the extras the run asks for,
and its build requirements (slipway is installed without build isolation, so that step runs
offline). An image's own torch is pinned in a constraints file, not named: NGC's pre-release
(2.6.0a0+ecf3bae) does not satisfy `torch>=2.6`, and pip would fetch a second one.
`--install` runs pip against the base's pins (PIP_CONSTRAINT); a pin in conflict is named in
one line with the way out, `--lift NAMES` (docs/image.md).

    python3 pip_requirements.py pyproject.toml requirements.txt constraints.txt [--extras float8]
        [--lift "fsspec pyarrow"] [--install]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Iterator, Optional

EXTRAS = ("trainer", "plot")
NAME_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
# pip's resolver, explaining a conflict: "The conflict is caused by:" then one line per party.
CONSTRAINED = re.compile(r"^\s*The user requested \(constraint\) (\S+)")
NEEDS = re.compile(r"^\s*(?:(\S+ \S+) depends on|The user requested) (\S.*)$")
LIFTED_FILE = "base-constraints.txt"  # the base's pins less the lifted ones, beside requirements.txt


def toml_loads(text: str) -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # older images: pip vendors a TOML reader
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    match = NAME_RE.match(req)
    if not match:
        raise ValueError(f"cannot read a package name from requirement {req!r}")
    return canonical(match.group(1))


def requirements(pyproject: dict, *, have_torch: bool, extras: tuple[str, ...] = EXTRAS) -> list[str]:
    """Runtime dependencies, `extras` and build requirements; torch only when the image has none."""
    project = pyproject["project"]
    reqs = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise KeyError(f"pyproject.toml has no optional-dependencies.{extra}")
        reqs += optional[extra]
    reqs += pyproject.get("build-system", {}).get("requires", [])
    if have_torch:
        reqs = [r for r in reqs if requirement_name(r) != "torch"]
    return reqs


def _constraint_lines(constraint: str) -> Iterator[tuple[str, str, Optional[str]]]:
    """(file, line, the pin it holds or None) for each line of the files a PIP_CONSTRAINT value
    names (space-separated, as pip reads it). URLs and unreadable files are skipped."""
    for path in constraint.split():
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            text = line.split("#", 1)[0].strip()
            yield path, line, text if text and not text.startswith("-") and NAME_RE.match(text) else None


def base_pins(constraint: str) -> dict[str, tuple[str, str]]:
    """The pins of the files a PIP_CONSTRAINT value names: canonical name -> (the pin as written, the file)."""
    pins: dict[str, tuple[str, str]] = {}
    for path, _, pin in _constraint_lines(constraint):
        if pin:
            pins.setdefault(requirement_name(pin), (pin, path))
    return pins


def lift_pins(constraint: str, names: set[str], out: Path) -> tuple[str, list[str]]:
    """The base's constraints less the pins of `names`, as file `out`: (its PIP_CONSTRAINT value, the pins lifted)."""
    kept, lifted = [], []
    for _, line, pin in _constraint_lines(constraint):
        if pin and requirement_name(pin) in names:
            lifted.append(pin)
        else:
            kept.append(line)
    out.write_text("".join(line + "\n" for line in kept))
    return str(out), lifted


def explain_conflict(output: str, pins: dict[str, tuple[str, str]], lifted: set[str]) -> str | None:
    """One line for pip's ResolutionImpossible when a base pin is a party to it; None otherwise."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("The conflict is caused by")), None)
    if start is None:
        return None
    block = list(itertools.takewhile(str.strip, lines[start + 1:]))
    for line in block:
        m = CONSTRAINED.match(line)
        if not m or (name := requirement_name(m.group(1))) not in pins:
            continue
        pin, where = pins[name]
        wants = []
        for other in block:  # pip names every party; the ones the pinned version does not satisfy
            n = NEEDS.match(other)
            if n and not CONSTRAINED.match(other):
                spec = n.group(2).strip()
                if requirement_name(spec) == name and _excludes(spec, pin):
                    wants.append(f"{n.group(1) or 'slipway'} needs {spec}")
        why = "; ".join(wants) or (f"pip finds no {pin} to install (neither on the index nor in image.wheelhouse)"
                                   if name in _unavailable(lines) else "slipway needs another version")
        lift = " ".join(sorted(lifted | {name}))
        return (f"dependencies FAILED: the base image pins {pin} in its pip constraints ({where}, PIP_CONSTRAINT), "
                f"but {why}: set image.build_args."
                f"PIP_CONSTRAINT_LIFT: \"{lift}\" to lift that pin for slipway's dependencies (the base's own "
                "packages were built against it: check they still work), or use a base image whose pins fit")
    return None


def _excludes(spec: str, pin: str) -> bool:
    """Whether requirement `spec` as pip prints it ("fsspec<=2026.9.0 and >=2023.1.0") rules out the
    version `pin` fixes ("fsspec==2021.4.0"); True where that cannot be told."""
    version = pin.split("==", 1)[1].strip() if "==" in pin else None
    rule = re.sub(r"^[A-Za-z0-9._-]+(\[[^\]]*\])?", "", spec).replace(" and ", ",").split(";")[0].strip()
    try:
        from pip._vendor.packaging.specifiers import SpecifierSet
        return version is None or not SpecifierSet(rule).contains(version, prereleases=True)
    except (ImportError, ValueError):  # no vendored packaging; InvalidSpecifier is a ValueError
        return True


def _unavailable(lines: list[str]) -> set[str]:
    """The packages pip says it found no distribution of, under "no matching distributions available"."""
    names: set[str] = set()
    for i, line in enumerate(lines):
        if "no matching distributions available" in line:
            for item in lines[i + 1:]:
                if not item.startswith((" ", "\t")) or not item.strip():
                    break
                names.add(canonical(item.strip()))
    return names


def install(req_out: Path, constraints_out: Path, lift: set[str]) -> int:
    """pip install the requirements against the base's pins (less the lifted ones)."""
    env = dict(os.environ)
    constraint = env.get("PIP_CONSTRAINT", "")
    pins = base_pins(constraint)
    if lift:
        unknown = sorted(lift - set(pins))
        if unknown:
            print(f"pip_requirements: PIP_CONSTRAINT_LIFT names {' '.join(unknown)}, which the base does not pin "
                  f"({constraint or 'no PIP_CONSTRAINT'}): nothing to lift for {'it' if len(unknown) == 1 else 'them'}",
                  flush=True)
        env["PIP_CONSTRAINT"], lifted = lift_pins(constraint, lift, req_out.with_name(LIFTED_FILE))
        if lifted:
            print(f"pip_requirements: lifting the base's pins {' '.join(lifted)} for slipway's dependencies "
                  "(PIP_CONSTRAINT_LIFT)", flush=True)
    elif pins:
        print(f"pip_requirements: resolving against the base's {len(pins)} pins ({constraint})", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "-r", str(req_out), "-c", str(constraints_out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        seen.append(line)
    rc = proc.wait()
    if rc != 0 and (line := explain_conflict("".join(seen), base_pins(env.get("PIP_CONSTRAINT", "")), lift)):
        print(line, flush=True)
    return rc


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pip_requirements.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("requirements", type=Path, help="written: what pip installs")
    parser.add_argument("constraints", type=Path, help="written: the base's torch pinned, if it has one")
    parser.add_argument("--extras", default="", help="extras of pyproject.toml beside trainer, space-separated")
    parser.add_argument("--lift", default="", help="packages whose pins in the base's PIP_CONSTRAINT are lifted")
    parser.add_argument("--install", action="store_true", help="then pip install them")
    args = parser.parse_args(argv)
    extras = EXTRAS + tuple(e for e in args.extras.replace(",", " ").split() if e not in EXTRAS)
    try:
        torch_version: Optional[str] = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    try:
        reqs = requirements(toml_loads(args.pyproject.read_text()), have_torch=torch_version is not None,
                            extras=extras)
    except KeyError as exc:
        print(f"dependencies FAILED: {exc.args[0]} (EXTRAS={args.extras!r}): name an extra pyproject.toml has",
              flush=True)
        return 1
    args.requirements.write_text("".join(r + "\n" for r in reqs))
    args.constraints.write_text(f"torch=={torch_version}\n" if torch_version else "")
    kept = f"keeping the image's torch {torch_version}" if torch_version else "the image has no torch: installing one"
    print(f"pip_requirements: {len(reqs)} requirements (extras {', '.join(extras)}; {kept}): {' '.join(reqs)}",
          flush=True)
    if not args.install:
        return 0
    return install(args.requirements, args.constraints, {canonical(n) for n in args.lift.replace(",", " ").split()})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
