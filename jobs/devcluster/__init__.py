"""The local dev cluster: a real Slurm on this machine (munged, slurmctld and N slurmd "nodes", each
in its own namespaces) to try slipway on (`slipway cluster up | env | status | down`, docs/clusters.md),
and the one the tests (tests/slurm_fixtures.py) and benchmarks start for themselves. Needs root,
slurm-wlm (slurmctld, slurmd, client commands), munge, iproute2, util-linux (nsenter, unshare).
"""

from jobs.devcluster.command import main
from jobs.devcluster.daemons import LocalSlurmCluster, unavailable_reason
from jobs.devcluster.host import ClusterError, alive, leftovers, read_registry, teardown
from jobs.devcluster.spec import ClusterSpec, default_state_dir, is_local_conf, render_slurm_conf, spec_of_running

__all__ = ["ClusterError", "ClusterSpec", "LocalSlurmCluster", "alive", "default_state_dir", "is_local_conf",
           "leftovers", "main", "read_registry", "render_slurm_conf", "spec_of_running", "teardown",
           "unavailable_reason"]
