"""Tensor parallelism on PyTorch's own stack (DTensor, ``parallelize_module``, ``DeviceMesh``)
and sharded checkpoints (``torch.distributed.checkpoint``).

plan.py derives the split of a model from its config once, for every family; apply.py applies
it to a built model in place (modules and state-dict keys unchanged). Training
(training/distributed.py) and the CLI only call these.
"""

from .apply import local_bytes, parallelize, tp_mesh
from .plan import TPPlan, check_tp, tp_plan

__all__ = ["TPPlan", "check_tp", "local_bytes", "parallelize", "tp_mesh", "tp_plan"]
