"""`slipway gpu-check`: does this GPU node train correctly, and fast? One command, on the node,
offline, with the node's own PyTorch, in at most ten minutes, written up in DIR/report.md and
DIR/report.json; its parts and budgets are docs/trainer.md's "checking a new cluster's GPU node".

The host side imports no torch: what measures runs as `python -m trainer...` (trainer/gpucheck.py,
trainer/speed.py) with this Python, whose torch is the node's. What it needs besides travels as a
directory of wheels (jobs/gpucheck/wheels.py).
"""

from jobs.gpucheck.check import BUDGETS
from jobs.gpucheck.parts import gpu_check

__all__ = ["BUDGETS", "gpu_check"]
