"""Runs: the run directory, the unit of reproducibility, and what submits into it.

    run.py        a run directory on disk (`Run`), finding and listing runs, the manifest's writer
    submit.py     a submission sealed once, the run directory written whole, sbatch and its record
    checks.py     what must hold before a launch writes a run
    manifest.py   manifest.json, typed, and what a damaged one says
    lifecycle.py  what became of a launch (events.log, Slurm, the local processes)
    image.py      the image a run pins, and what a build of its settings would be now
    container.py  the run's container environment and the paths it mounts
    code.py       the code snapshot and its store
    lock.py       one launch of a run at a time
    sweep.py      a sweep: its record, its axes and points, their names
    arrays.py     a sweep planned (every point checked and sealed) and queued as Slurm job arrays
"""

from jobs.runs.run import Run, Unreadable, find_run, pinned_images, runs_root, scan_runs, update_manifest
from jobs.runs.checks import check_submittable, config_difference
from jobs.runs.submit import (Sealed, nothing_to_train, no_world_write, preparation, prepare_run, record_code, seal,
                              submit, submit_prepare, unprepared_data)

__all__ = ["Run", "Sealed", "Unreadable", "check_submittable", "config_difference", "find_run", "no_world_write",
           "nothing_to_train", "pinned_images", "preparation", "prepare_run", "record_code", "runs_root", "scan_runs",
           "seal", "submit", "submit_prepare", "unprepared_data", "update_manifest"]
