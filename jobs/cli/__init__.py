"""`slipway` (= `python -m jobs`): the command line on the login node. It parses arguments, loads
the one config tree and hands it to the module that does the work (commands.py says which);
errors in what the user gave print one line and exit 2."""

from jobs.cli.commands import main

__all__ = ["main"]
