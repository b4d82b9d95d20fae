"""What pip installs into the image besides slipway itself.

Runs inside the image build (stdlib only, any Python >= 3.8) and on the host (the
tests compute the wheelhouse from it). The list is slipway's runtime dependencies
plus its `trainer` extra, plus its build requirements (`[build-system] requires`:
slipway itself is installed without build isolation, so that step can run
offline, and a base's older setuptools cannot read the PEP 639 license field). When the image already has a torch (NGC), torch is left
out and pinned to the installed version in a constraints file: NGC's torch is a
pre-release such as 2.6.0a0+ecf3bae that does not satisfy `torch>=2.6`, so naming
torch would make pip fetch a second one.

    python3 pip_requirements.py pyproject.toml requirements.txt constraints.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

EXTRAS = ("trainer",)
NAME_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


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
    """Runtime dependencies plus `extras`; torch only when the image has none."""
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


def installed_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    pyproject_path, req_out, constraints_out = map(Path, argv)
    torch_version = installed_version("torch")
    reqs = requirements(toml_loads(pyproject_path.read_text()), have_torch=torch_version is not None)
    req_out.write_text("".join(r + "\n" for r in reqs))
    constraints_out.write_text(f"torch=={torch_version}\n" if torch_version else "")
    kept = f"keeping the image's torch {torch_version}" if torch_version else "the image has no torch: installing one"
    print(f"pip_requirements: {len(reqs)} requirements ({kept}): {' '.join(reqs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
