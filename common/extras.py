"""The optional installs a command may need beyond the base one, said in one line when missing.
`pip install slipway` is the login node's install (`slipway submit` reads the token cache without
numpy); the commands doing the trainer's work here (`slipway prepare`, `local`, `plot`) call
`require` first: one line naming the pip install, exit 2, nothing written, not an import traceback
halfway through. Imports neither torch nor the host side; looking a module up imports nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable

from common.errors import ConfigError

# The modules each extra of pyproject.toml's [project.optional-dependencies] brings that the
# commands import (distribution and module names agree for all of them).
EXTRAS: dict[str, tuple[str, ...]] = {
    "trainer": ("torch", "numpy", "tokenizers", "datasets", "safetensors"),
    "plot": ("matplotlib",),
}


def require(command: str, extra: str, modules: Iterable[str] | None = None, instead: str = "") -> None:
    """A ConfigError unless `modules` (default: `extra`'s) import here; `instead`: another way to the result."""
    absent = [m for m in (EXTRAS[extra] if modules is None else modules) if importlib.util.find_spec(m) is None]
    if absent:
        raise ConfigError(command, f"needs {', '.join(absent)} (the {extra} extra), which this Python "
                                   f"({sys.executable}) lacks: pip install 'slipway[{extra}]'"
                                   f"{f', or {instead}' if instead else ''}")
