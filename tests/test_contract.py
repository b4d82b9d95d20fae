"""The house's contract, read from the code's own imports.

- the host (jobs/, edf/, containers/) imports from trainer/ only `trainer.config`, and the trainer's
  own work through one lazy door, jobs/trainer_door.py;
- common/, below both, imports neither side;
- trainer/ never imports the host;
- what the host may import of trainer/ (its config, the door's modules) and every module of common/
  import with torch (and numpy, tokenizers, datasets) unimportable, as on a login node: torch-free
  by construction, not by an unwritten rule;
- no name that is private (a leading `_`) crosses a package line, in the product or from the tests.
"""

from __future__ import annotations

import ast
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


def test_the_door_names_every_module_it_opens():
    from jobs import trainer_door

    opened = {module for _, module, _ in _imports(ROOT / DOOR) if _top(module) == "trainer"}
    assert opened and opened <= set(trainer_door.MODULES) | {"trainer.data_cache"}, opened


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
    from jobs import trainer_door

    names = ["trainer.config", *trainer_door.MODULES, "jobs.trainer_door"]
    names += [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in _modules("common")]
    names = [n.removesuffix(".__init__") for n in names]
    r = subprocess.run([sys.executable, "-c", _BLOCKED, *names], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("where", ["product", "tests"])
def test_no_private_name_crosses_a_package_line(where):
    packages = ("common", "trainer", *HOST)
    paths = _modules(*packages) if where == "product" else sorted((ROOT / "tests").glob("*.py"))
    strays = []
    for path in paths:
        rel = path.relative_to(ROOT)
        own = rel.parts[0]
        for line, module, names in _imports(path):
            if _top(module) not in packages or (where == "product" and _top(module) == own):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                strays.append(f"{rel}:{line} imports {', '.join(private)} from {module}")
    assert not strays, "; ".join(strays)
