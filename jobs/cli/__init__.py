"""`slipway` (= `python -m jobs`): the command line on the login node.

Parses arguments, loads the one config tree, and hands it to the module that does the work
(commands.py: the parser, `main` and the commands that read a run; launch.py: those that make
one; sweep.py: `slipway sweep` and what reads a sweep or runs together). Errors in what the user gave print one line and exit 2.
"""

from jobs.cli.commands import main

__all__ = ["main"]
