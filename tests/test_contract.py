"""The house's contract, read from the code's own imports.

- the host (jobs/, edf/, containers/) imports from trainer/ only `trainer.config`, and the trainer's
  own work through one lazy door, jobs/trainer_door.py;
- common/, below both, imports neither side;
- trainer/ never imports the host;
- what the host may import of trainer/ (its config, the door's modules) and every module of common/
  import with torch (and numpy, tokenizers, datasets) unimportable, as on a login node: torch-free
  by construction, not by an unwritten rule;
- no name that is private (a leading `_`) leaves its module in the product, nor crosses into the tests;
- the product's rooms are layered: every import points down the order the README states, and no
  modules import each other in a circle (the graph computed from every import, function-level and
  TYPE_CHECKING ones included, relative ones resolved, a package's re-exports followed to the
  module that defines the name).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

HOST = ("jobs", "edf", "containers")
DOOR = "jobs/trainer_door.py"


def _modules(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) for every import in `path`, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return found


def _top(module: str) -> str:
    return module.split(".")[0]


def test_the_host_reaches_into_the_trainer_through_its_config_and_the_door_only():
    strays = []
    for path in _modules(*HOST):
        rel = path.relative_to(ROOT).as_posix()
        for line, module, names in _imports(path):
            if _top(module) != "trainer" or rel == DOOR:
                continue
            if module == "trainer.config" or (module == "trainer" and names == ["config"]):
                continue
            strays.append(f"{rel}:{line} imports {module}")
    assert not strays, "the host imports the trainer beyond trainer.config (go through jobs/trainer_door.py): " + \
        "; ".join(strays)


def _behind_the_door() -> list[str]:
    """The trainer modules the door imports."""
    found = sorted({module for _, module, _ in _imports(ROOT / DOOR) if _top(module) == "trainer"})
    assert "trainer.prepare" in found and "trainer.plot" in found, found
    return found


def test_common_imports_neither_side_and_the_trainer_never_the_host():
    strays = [f"{p.relative_to(ROOT)}:{line} imports {module}"
              for p in _modules("common") for line, module, _ in _imports(p)
              if _top(module) in (*HOST, "trainer")]
    strays += [f"{p.relative_to(ROOT)}:{line} imports {module}"
               for p in _modules("trainer") for line, module, _ in _imports(p) if _top(module) in HOST]
    assert not strays, "; ".join(strays)


# Run in a fresh interpreter: a finder ahead of every other refuses the heavy packages.
_BLOCKED = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy", "tokenizers", "datasets", "safetensors", "matplotlib"):
            raise ImportError(f"{name} is not importable here (the login node's install)")
sys.meta_path.insert(0, Refuse())
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
"""


def test_what_the_host_may_reach_of_the_trainer_and_all_of_common_import_without_torch():
    names = ["trainer.config", *_behind_the_door(), "jobs.trainer_door"]
    names += [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in _modules("common")]
    names = [n.removesuffix(".__init__") for n in names]
    r = subprocess.run([sys.executable, "-c", _BLOCKED, *names], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("where", ["product", "tests"])
def test_no_private_name_leaves_its_module(where):
    """The product borrows no private name from another module (by `from m import _x` or `m._x`);
    the tests none from the product's packages."""
    packages = ("common", "trainer", *HOST)
    paths = _modules(*packages) if where == "product" else sorted((ROOT / "tests").glob("*.py"))
    strays = []
    for path in paths:
        rel = path.relative_to(ROOT)
        for line, module, names in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if _top(module) in packages and private:
                strays.append(f"{rel}:{line} imports {', '.join(private)} from {module}")
        tree = ast.parse(path.read_text(), str(path))
        bound = set()  # the names bound here to the product's modules and objects
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and _top(node.module or "") in packages:
                bound |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                bound |= {a.asname or a.name.split(".")[0] for a in node.names if _top(a.name) in packages}
        if where == "product":
            strays += [f"{rel}:{node.lineno} uses {node.value.id}.{node.attr}" for node in ast.walk(tree)
                       if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                       and node.value.id in bound and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert not strays, "; ".join(strays)


# ---------------------------------------------------------------- the rooms and the import graph


def _product() -> dict[str, Path]:
    """Every module of the product by its dotted name (a package by its own: `jobs.slurm`)."""
    found = {}
    for path in _modules("common", "trainer", *HOST):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _graph(product: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the first line that does}, among the product's modules."""
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in product.items()}

    def absolute(name: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".")[: None if product[name].name == "__init__.py" else -1]
        return ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))

    def defining(module: str, name: str, seen: frozenset = frozenset()) -> str | None:
        """The module that `from module import name` reaches, through a package's re-exports."""
        if f"{module}.{name}" in product:
            return f"{module}.{name}"
        if module not in product:
            return None
        if product[module].name == "__init__.py" and (module, name) not in seen:
            for node in trees[module].body:
                if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                    original = next(a.name for a in node.names if (a.asname or a.name) == name)
                    return defining(absolute(module, node), original, seen | {(module, name)}) or module
        return module

    graph: dict[str, dict[str, int]] = {name: {} for name in product}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in product]
            elif isinstance(node, ast.ImportFrom):
                targets = [defining(absolute(name, node), a.name) for a in node.names]
            else:
                continue
            for target in targets:
                if target and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def _rooms() -> list[str]:
    """The README's order of the rooms, bottom to top, as dotted module names."""
    readme = (ROOT / "README.md").read_text()
    paragraph = re.search(r"^The rooms, bottom to top.*?(?=\n\n|\Z)", readme, re.M | re.S)
    assert paragraph, "README.md states no order of the rooms (a paragraph 'The rooms, bottom to top ...')"
    return [p.removesuffix("/").removesuffix(".py").replace("/", ".") for p in re.findall(r"`([^`]+)`", paragraph[0])]


def _room(module: str, rooms: list[str]) -> int | None:
    """The index of `module`'s room: the longest room that is it or holds it."""
    held = [i for i, room in enumerate(rooms) if module == room or module.startswith(room + ".")]
    return max(held, key=lambda i: len(rooms[i])) if held else None


def layering_faults(graph: dict[str, dict[str, int]], rooms: list[str], product: dict[str, Path]) -> list[str]:
    """Each module in no room, each import up the order, each circle: one line each."""
    faults, where = [], {module: _room(module, rooms) for module in graph}
    for module, imports in sorted(graph.items()):
        if where[module] is None and (imports or any(module in other for other in graph.values())):
            faults.append(f"{module} is in no room of the README's order: add its room there")
        for target, line in sorted(imports.items()):
            if None not in (where[module], where[target]) and where[target] > where[module]:
                faults.append(f"{product[module].relative_to(ROOT)}:{line} imports {target}: an arrow up, from room "
                              f"{rooms[where[module]]} to {rooms[where[target]]}")
    reach = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            if (module := todo.pop()) not in seen:
                seen.add(module)
                todo += graph[module]
        reach[start] = seen
    circles = {frozenset({m for m in reach[a] if a in reach[m]}) for a in graph if a in reach[a]}
    faults += [f"an import circle: {' <-> '.join(sorted(circle))}" for circle in sorted(circles, key=sorted)]
    return faults


def test_every_import_points_down_the_readmes_rooms_and_none_goes_round():
    product = _product()
    faults = layering_faults(_graph(product), _rooms(), product)
    assert not faults, "\n".join(faults)


def test_the_layering_check_sees_an_arrow_up_a_circle_and_a_module_in_no_room():
    product = _product()
    graph = _graph(product)
    assert graph["jobs.slurm.script"]["jobs.config"]  # `from jobs.config import Config`, as read
    assert "jobs.slurm.client" in graph["jobs.slurm.bad_nodes"]  # `from jobs.slurm import client as slurm`
    assert "jobs.slurm.client" in graph["jobs.cli.commands"]  # `from jobs.slurm import SlurmError`: re-exported
    rooms = _rooms()
    graph["common.errors"]["jobs.cli.commands"] = 1
    graph["jobs.cli.commands"]["common.errors"] = 1
    graph["jobs.stray"] = {"common.errors": 1}
    product["jobs.stray"] = ROOT / "jobs" / "stray.py"
    faults = layering_faults(graph, rooms, product)
    assert any("common/errors.py:1 imports jobs.cli.commands: an arrow up" in f for f in faults), faults
    assert any(f.startswith("an import circle: ") and "common.errors" in f for f in faults), faults
    assert "jobs.stray is in no room of the README's order: add its room there" in faults, faults
