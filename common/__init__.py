"""The ground floor both sides stand on: what the host (jobs/, edf/, containers/) and the trainer
share, with no torch and nothing of either side.

- errors.py: ConfigError, the one error for bad input, and how a message quotes a value;
- secrets.py: the secret policy, which every field, file and message obeys, over detect-secrets and
  slipway's plugins for it (secret_plugins.py); baseline.py: what a project accepts of it;
- yaml.py and schema.py: configs read with the schema's rules into dataclasses, strictly;
- edge.py: every entry point's error edge (one line, exit 2; a bug says so, exit 70);
- environ.py: values from the environment, checked like config values;
- fs.py: atomic writes and file digests;
- rundir.py: the run-directory protocol (file names, exit codes, events) the batch script,
  the trainer and the host agree on.
"""
