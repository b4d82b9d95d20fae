"""Runs: the run directory, the unit of reproducibility, and what submits into it, a module per part."""

from jobs.runs.run import Run, Unreadable, find_run, pinned_images, runs_root, scan_runs, update_manifest
from jobs.runs.checks import check_submittable, config_difference
from jobs.runs.submit import (Sealed, nothing_to_train, no_world_write, preparation, prepare_run, record_code, seal,
                              submit, submit_prepare, unprepared_data)

__all__ = ["Run", "Sealed", "Unreadable", "check_submittable", "config_difference", "find_run", "no_world_write",
           "nothing_to_train", "pinned_images", "preparation", "prepare_run", "record_code", "runs_root", "scan_runs",
           "seal", "submit", "submit_prepare", "unprepared_data", "update_manifest"]
