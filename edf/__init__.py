"""The container environment: one model, rendered as an EDF (CSCS Container
Engine) or as pyxis `srun` flags.

    env = Environment.from_container(cfg.container)   # validated, errors name container.*
    text = render_edf(env)                             # EDF TOML (tomli-w)
    env == parse_edf(text)                             # and back (text or path)
    write_edf(env, run_dir / "env.toml")               # atomic; refuses a different file
    install_edf(env, "name")                           # into the first EDF_PATH directory
    pyxis = to_pyxis_args(env)                         # .args, .exports, .warnings
"""

from edf.environment import MOUNT_FLAGS, Environment, Mount
from edf.files import (
    TOP_KEYS,
    edf_search_path,
    find_edf,
    install_edf,
    parse_edf,
    render_edf,
    resolve_base,
    write_edf,
)
from edf.pyxis import PyxisArgs, pyxis_exports, to_pyxis_args

__all__ = [
    "MOUNT_FLAGS",
    "TOP_KEYS",
    "Environment",
    "Mount",
    "PyxisArgs",
    "edf_search_path",
    "find_edf",
    "install_edf",
    "parse_edf",
    "pyxis_exports",
    "render_edf",
    "resolve_base",
    "to_pyxis_args",
    "write_edf",
]
