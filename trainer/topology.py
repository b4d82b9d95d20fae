"""What a node is and has, as its tools and the kernel say it: room where checkpoints go, NUMA nodes
and their CPUs, the GPUs' PCI addresses and NUMA nodes, and whether `torchrun --numa-binding` can
bind each GPU's rank. Read by the preflight, the checkpointer and `slipway gpu-check`; no torch at
import."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Optional

from common.errors import human
from common.fs import existing_parent


def check_free_space(checkpoint_dir: Path, needed: int) -> tuple[bool, str]:
    """Room for one more checkpoint on the filesystem of `checkpoint_dir` (or its nearest existing parent)."""
    where = existing_parent(checkpoint_dir)
    try:
        free = shutil.disk_usage(where).free
    except OSError as exc:
        return False, f"free space at {where} (where checkpoints go) cannot be read ({exc.strerror or exc})"
    if free < needed:
        return False, (f"{human(free)} free at {where} (where checkpoints go), one checkpoint needs about "
                       f"{human(needed)}: free space there or set checkpoint.dir elsewhere")
    return True, f"{human(free)} free for checkpoints (one needs about {human(needed)})"


def tool_output(*argv: str) -> tuple[Optional[str], str]:
    """A tool's standard output; None and why where it gives none (not installed, did not run, failed)."""
    exe = shutil.which(argv[0])
    if exe is None:
        return None, f"{argv[0]} is not in this node's container"
    try:
        proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{argv[0]} did not run ({exc})"
    if proc.returncode != 0:
        return None, f"{argv[0]} failed (exit {proc.returncode}: {' '.join((proc.stderr or proc.stdout).split())[:200]})"
    return proc.stdout, ""


def numactl_show() -> tuple[Optional[str], str]:
    """What `numactl --show` says, in one line; None and why where it does not run."""
    out, why = tool_output("numactl", "--show")
    return (None, why) if out is None else ("; ".join(line.strip() for line in out.splitlines() if line.strip()), "")


SYSFS = Path("/sys")  # where the kernel tells which NUMA node holds which CPUs and PCI devices


def cpu_set(text: str) -> set[int]:
    """A kernel CPU list ("0-71,144-215"; "" for none) as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes(sysfs: Path = SYSFS) -> dict[int, set[int]]:
    """Each NUMA node's CPUs; an empty set for a node of memory alone (GH200's HBM, CXL)."""
    nodes = {}
    for path in sorted((sysfs / "devices" / "system" / "node").glob("node[0-9]*")):
        try:
            nodes[int(path.name[4:])] = cpu_set((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def gpu_pci_addresses(count: int) -> list[str]:
    """The sysfs PCI address of CUDA devices 0..count-1, as torch's NUMA binding forms it."""
    import torch

    props = [torch.cuda.get_device_properties(i) for i in range(count)]
    return [f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0" for p in props]


def gpu_numa_node(pci_address: str, sysfs: Path = SYSFS) -> Optional[int]:
    """The NUMA node the kernel puts a PCI device on (-1, one node only, is 0 as for torch); None: not in sysfs."""
    try:
        return max(int((sysfs / "bus" / "pci" / "devices" / pci_address / "numa_node").read_text().strip()), 0)
    except (OSError, ValueError):
        return None


def numa_binding(pci_addresses: list[str], allowed: set[int], sysfs: Path = SYSFS) -> tuple[bool, list[str]]:
    """Whether `torchrun --numa-binding=node` can bind each GPU's rank to CPUs of its NUMA node that this
    process may use (`allowed`: its affinity, narrowed by Slurm's cgroup): (ok, one line a GPU, a
    failure's one-line reason first)."""
    nodes = numa_nodes(sysfs)
    lines, bad = [], []
    for i, address in enumerate(pci_addresses):
        node = gpu_numa_node(address, sysfs)
        cpus = nodes.get(node, set()) if node is not None else set()
        usable = cpus & allowed
        of = "" if usable == cpus else f" of {cpu_ranges(cpus) or 'none'}"
        lines.append(f"GPU {i} ({address}) on NUMA node {node if node is not None else '?'} "
                     f"({cpu_ranges(usable) or 'no CPUs'}{of})")
        if node is None:
            bad.append(f"GPU {i}'s PCI device {address} is not in {sysfs}/bus/pci/devices, where torchrun "
                       "--numa-binding=node reads its NUMA node (it would stop before training): mount /sys in "
                       "the container, or set launch.preset: none")
        elif not usable:
            with_cpus = sorted(n for n, c in nodes.items() if c & allowed)
            what = "has no CPUs (a node of memory alone, as a GH200's HBM)" if not cpus else \
                f"has no CPU this job may use (its CPUs {cpu_ranges(cpus)}, the job's {cpu_ranges(allowed)})"
            bad.append(f"GPU {i} ({address}) is on NUMA node {node}, which {what}: torchrun --numa-binding=node would "
                       f"bind its rank to no core and stop before training (NUMA nodes with CPUs here: "
                       f"{', '.join(map(str, with_cpus)) or 'none'}); set launch.launcher: srun (srun binds the cores "
                       "next to each GPU) or launch.preset: none")
    return not bad, bad[:1] + lines if bad else lines


def cpu_ranges(cpus: set[int]) -> str:
    """A CPU set in the kernel's list form (0-3,8)."""
    cpus = sorted(cpus)
    starts = [c for i, c in enumerate(cpus) if i == 0 or cpus[i - 1] != c - 1]
    ends = [c for i, c in enumerate(cpus) if i == len(cpus) - 1 or cpus[i + 1] != c + 1]
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in zip(starts, ends))
