"""The container environment: one model (also the config's `container:` section),
rendered as an EDF (CSCS Container Engine) or as `srun` flags (pyxis, or
`--environment=` for the Container Engine).

    env = cfg.container                                # validated at load, errors name container.*
    text = render_edf(env)                             # EDF TOML (tomli-w)
    env == parse_edf(text)                             # and back (text or path)
    env, problems = check_edf(path)                    # a hand-written EDF: every problem in it
    write_edf(env, run_dir / "env.toml")               # atomic; refuses a different file
    install_edf(env, "name")                           # into the first EDF_PATH directory
    flags = srun_flags(env, edf_file)                  # .args, .exports, .warnings, .expanded()
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
