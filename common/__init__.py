"""The ground floor both sides stand on: what the host (jobs/, edf/, containers/) and the trainer
share, with no torch and nothing of either side (its modules: README.md's layout)."""
