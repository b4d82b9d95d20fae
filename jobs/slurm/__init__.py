"""Slurm: its client tools (client.py, the one wrapper, `srun_argv` for every srun), the bad nodes a
cluster remembers, and the batch script a run submits (script.py) with its job library (*.sh)."""

from jobs.slurm.client import (ACTIVE_STATES, JobInfo, SlurmError, associations, available, check_sbatch_environment,
                               cluster_config, hostnames, job_info, jobs_info, max_array_size, partition_nodes,
                               partitions, ping, responding_nodes, sacct_argv, sbatch, scancel, squeue_argv, srun_argv,
                               usable_state)

__all__ = ["ACTIVE_STATES", "JobInfo", "SlurmError", "associations", "available", "check_sbatch_environment",
           "cluster_config", "hostnames", "job_info", "jobs_info", "max_array_size", "partition_nodes", "partitions",
           "ping", "responding_nodes", "sacct_argv", "sbatch", "scancel", "squeue_argv", "srun_argv", "usable_state"]
