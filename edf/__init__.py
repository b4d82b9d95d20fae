"""The container environment: one model (also the config's `container:` section), rendered as
an EDF (CSCS Container Engine) or as `srun` flags (pyxis, or `--environment=` for the Container
Engine); edf/files.py reads, checks, merges and writes EDF files.
"""

from edf.environment import Environment, Mount, is_local_image
from edf.files import (
    check_edf,
    expand_host,
    install_edf,
    parse_edf,
    render_edf,
    resolve_base,
)
from edf.srun import srun_flags

__all__ = [
    "Environment",
    "Mount",
    "check_edf",
    "expand_host",
    "install_edf",
    "is_local_image",
    "parse_edf",
    "render_edf",
    "resolve_base",
    "srun_flags",
]
