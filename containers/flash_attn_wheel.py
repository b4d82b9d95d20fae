"""Pick a prebuilt flash-attn wheel from the wheelhouse that fits this Python and torch.

Runs inside the image build (stdlib only, any Python >= 3.8); the tests call `pick` on the host.
pip checks a wheel's Python and platform tags but not the torch it was built against, and a
flash-attn built for another torch installs, then fails at import (undefined symbols): each of
cuN, torchX.Y and cxx11abiTRUE/FALSE a wheel's local version names
(`flash_attn-2.8.3+cu13torch2.10cxx11abiTRUE-cp312-...whl`) must match; a wheel without them
(built with `pip wheel` in the base) is taken on trust, and the image's smoke test imports it.

    python3 flash_attn_wheel.py WHEELHOUSE VERSION   # prints the wheel's path, or nothing
"""

from __future__ import annotations

import platform
import re
import sys
from pathlib import Path
from typing import NamedTuple, Optional

WHEEL_RE = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)"
                      r"\.whl$")


class Target(NamedTuple):
    python: str  # cp312
    machine: str  # x86_64, aarch64
    torch: str  # 2.10 (major.minor)
    cuda: Optional[str]  # 13 (torch.version.cuda's major), None for a CPU torch
    cxx11abi: Optional[bool]


def rejection(filename: str, version: str, target: Target) -> Optional[str]:
    """Why this wheel does not fit (None: it fits)."""
    m = WHEEL_RE.match(filename)
    if not m:
        return "not a wheel file name"
    if re.sub(r"[-_.]+", "-", m["name"]).lower() != "flash-attn":
        return "not flash-attn"
    release, _, local = m["version"].partition("+")
    if version and release != version:
        return (f"version {release}, not FLASH_ATTN_VERSION={version} (set image.build_args.FLASH_ATTN_VERSION "
                "to use it)")
    pys = m["py"].split(".")
    if target.python not in pys and "py3" not in pys:
        return f"built for {m['py']}, this Python is {target.python}"
    if not any(p.endswith("_" + target.machine) or p == "any" for p in m["plat"].split(".")):
        return f"built for {m['plat']}, this machine is {target.machine}"
    torch = re.search(r"torch(\d+\.\d+)", local)
    if torch and torch.group(1) != target.torch:
        return f"built for torch {torch.group(1)}, the base has torch {target.torch}"
    cuda = re.search(r"cu(\d+)", local)
    if cuda and target.cuda is not None and not cuda.group(1).startswith(target.cuda):
        return f"built for CUDA {cuda.group(1)}, the base's torch uses CUDA {target.cuda}"
    abi = re.search(r"cxx11abi(TRUE|FALSE)", local, re.I)
    if abi and target.cxx11abi is not None and (abi.group(1).upper() == "TRUE") != target.cxx11abi:
        return f"built with cxx11abi{abi.group(1)}, the base's torch has the other C++ ABI"
    return None


def pick(names: list[str], version: str, target: Target) -> tuple[Optional[str], list[str]]:
    """The fitting wheel and one note per flash-attn wheel passed over. Among fitting ones, a
    wheel whose name says its torch beats one taken on trust; then the highest name."""
    fits, notes = [], []
    for name in sorted(names):
        if not name.endswith(".whl") or not re.match(r"flash[-_]attn-", name, re.I):
            continue
        why = rejection(name, version, target)
        if why:
            notes.append(f"flash-attn: not using {name}: {why}")
        else:
            fits.append(name)
    fits.sort(key=lambda name: (bool(re.search(r"\+\S*torch\d", name)), name))
    return (fits[-1] if fits else None), notes


def this_target() -> Target:
    import torch  # the base's own torch: only inside the image build

    release = torch.__version__.split("+")[0].split(".")
    cuda = torch.version.cuda.split(".")[0] if torch.version.cuda else None
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    return Target(f"cp{sys.version_info[0]}{sys.version_info[1]}", platform.machine(), ".".join(release[:2]),
                  cuda, None if abi is None else bool(abi))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    wheelhouse, version = Path(argv[0]), argv[1]
    names = [p.name for p in wheelhouse.iterdir()] if wheelhouse.is_dir() else []
    chosen, notes = pick(names, version, this_target())
    for note in notes:
        print(note, file=sys.stderr)
    if chosen:
        print(wheelhouse / chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
