"""Slurm: its client tools and the batch script a run submits.

- client.py: the one wrapper around sbatch, squeue, sacct, scancel, scontrol, sinfo and srun
  (every command line built there; `srun_argv` for every srun a run or a command starts);
- bad_nodes.py: the bad nodes a cluster remembers, which the batch script excludes;
- ranks.py, warm.py: how the ranks start, and the warm processes of `slipway run`;
- preflight.py: the batch script's preflight;
- script.py: the batch script's one render function, with the job library it pins and sources
  (job_lib.sh, bad_nodes_lib.sh, requeue_lib.sh, verify_lib.sh, pyxis_lib.sh).
"""

from jobs.slurm.client import (ACTIVE_STATES, JobInfo, SlurmError, associations, available, can_ask,
                               check_sbatch_environment, cluster_config, hostnames, job_info, jobs_info,
                               max_array_size, partition_nodes, partitions, ping, responding_nodes, sacct_argv, sbatch,
                               scancel, squeue_argv, srun_argv, usable_state)

__all__ = ["ACTIVE_STATES", "JobInfo", "SlurmError", "associations", "available", "can_ask", "check_sbatch_environment",
           "cluster_config", "hostnames", "job_info", "jobs_info", "max_array_size", "partition_nodes", "partitions",
           "ping", "responding_nodes", "sacct_argv", "sbatch", "scancel", "squeue_argv", "srun_argv", "usable_state"]
