"""xla_tp: PyTorch tensor-parallel plans on XLA through direct sharding calls.

Example::

    import xla_tp
    from xla_tp import ColwiseParallel, RowwiseParallel
    mesh = xla_tp.make_mesh(model=4)
    model = xla_tp.parallelize_xla(model, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=mesh)
"""
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel)
from torch.distributed.tensor.placement_types import Replicate, Shard

from .api import parallelize_module, parallelize_xla, plan_for, set_moe_options, unparallelize
from .auditing import AuditReport
from .auditing.run import audit
from .backends.jax import parallelize_jax
from .checkpoint import export_hf, load_checkpoint, save_checkpoint
from .errors import CheckpointError, GenerationError, MeshError, OptimizerError, PlanError
from .generation import generate
from .loss import loss_parallel
from .lowering.routed import moe_report
from .mesh import init_device_mesh, make_mesh
from .plan.hf import hf_plan
from .plan.registered import register_style
from .plan.rules import load_rules, regex_plan
from .plan.styles import ShardParams
from .plan.unplanned import unplanned_parameters
from .planners import Plan
from .state import layout_of, state_of

__all__ = [
    "AuditReport", "ColwiseParallel", "MeshError", "Plan", "PlanError", "PrepareModuleInput", "PrepareModuleInputOutput",
    "PrepareModuleOutput", "Replicate", "RowwiseParallel", "SequenceParallel", "Shard", "ShardParams",
    "audit", "hf_plan", "init_device_mesh", "layout_of", "load_rules", "loss_parallel", "make_mesh",
    "parallelize_jax", "parallelize_module", "parallelize_xla", "plan_for", "regex_plan", "state_of", "unparallelize",
    "unplanned_parameters",
]
__all__ += ["moe_report", "register_style", "set_moe_options"]  # mixture-of-experts layers, other libraries' styles
__all__ += ["CheckpointError", "OptimizerError", "export_hf", "load_checkpoint", "save_checkpoint"]  # training at scale
__all__ += ["GenerationError", "generate"]  # generation
