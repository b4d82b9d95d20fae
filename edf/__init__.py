"""The container environment: one model (also the config's `container:` section), rendered as
an EDF (CSCS Container Engine) or as `srun` flags (pyxis, or `--environment=` for the Container
Engine); edf/files.py reads, checks, merges and writes EDF files.
"""

from edf.environment import Environment, Mount, is_local_image
from edf.files import (
    check_edf,
    expand_host,
    find_edf,
    install_edf,
    parse_edf,
    render_edf,
    resolve_base,
    write_edf,
)
from edf.srun import srun_flags, to_pyxis_args

__all__ = [
    "Environment",
    "Mount",
    "check_edf",
    "expand_host",
    "find_edf",
    "install_edf",
    "is_local_image",
    "parse_edf",
    "render_edf",
    "resolve_base",
    "srun_flags",
    "to_pyxis_args",
    "write_edf",
]
