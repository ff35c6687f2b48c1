"""xla_tp: PyTorch tensor-parallel plans on XLA through direct sharding calls.

The planner, the plan formats, ``torch_plan`` and ``parallelize_dtensor`` (torch's own DTensor tensor
parallelism: TorchTPU, CUDA, CPU) need torch only; ``parallelize_xla`` and what runs on
XLA devices need torch_xla (where it cannot be imported they raise, when called, saying what to install),
``parallelize_jax`` needs JAX. Example::

    import xla_tp
    from xla_tp import ColwiseParallel, RowwiseParallel
    mesh = xla_tp.make_mesh(model=4)
    model = xla_tp.parallelize_xla(model, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=mesh)
"""
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel)
from torch.distributed.tensor.placement_types import Replicate, Shard

# the core and what needs torch only: plan formats, the planner, torch's own styles, the JAX backend's entry
from .adapters import has_torch_xla, needs_torch_xla
from .apply import plan_for, set_moe_options, unparallelize
from .auditing.report import AuditReport
from .backends.dtensor import parallelize_dtensor
from .backends.jax import parallelize_jax
from .errors import CheckpointError, GenerationError, MeshError, OptimizerError, PlanError
from .loss import loss_parallel
from .lowering.routed import moe_report
from .plan.hf import hf_plan
from .plan.registered import register_style
from .plan.rules import load_rules, regex_plan
from .plan.styles import ShardParams
from .plan.unplanned import unplanned_parameters
from .planners import Plan
from .planners.torch_plan import torch_plan
from .state import layout_of, state_of

if has_torch_xla():  # the torch_xla adapter; importing it turns SPMD on (the call-order contract: mesh.py)
    from .api import parallelize_module, parallelize_xla
    from .auditing.run import audit
    from .checkpoint import export_hf, load_checkpoint, save_checkpoint
    from .context_parallel import context_parallel
    from .generation import generate
    from .mesh import init_device_mesh, make_mesh
else:  # each raises, when called, saying what to install
    parallelize_module, parallelize_xla = needs_torch_xla("parallelize_module"), needs_torch_xla("parallelize_xla")
    audit, generate = needs_torch_xla("audit"), needs_torch_xla("generate")
    export_hf, load_checkpoint = needs_torch_xla("export_hf"), needs_torch_xla("load_checkpoint")
    save_checkpoint, context_parallel = needs_torch_xla("save_checkpoint"), needs_torch_xla("context_parallel")
    init_device_mesh, make_mesh = needs_torch_xla("init_device_mesh"), needs_torch_xla("make_mesh")

__all__ = [
    "AuditReport", "ColwiseParallel", "MeshError", "Plan", "PlanError", "PrepareModuleInput", "PrepareModuleInputOutput",
    "PrepareModuleOutput", "Replicate", "RowwiseParallel", "SequenceParallel", "Shard", "ShardParams",
    "audit", "hf_plan", "init_device_mesh", "layout_of", "load_rules", "loss_parallel", "make_mesh",
    "parallelize_dtensor", "parallelize_jax", "parallelize_module", "parallelize_xla", "plan_for", "regex_plan", "state_of", "torch_plan",
    "unparallelize", "unplanned_parameters",
]
__all__ += ["moe_report", "register_style", "set_moe_options"]  # mixture-of-experts layers, other libraries' styles
__all__ += ["CheckpointError", "OptimizerError", "export_hf", "load_checkpoint", "save_checkpoint"]  # training at scale
__all__ += ["GenerationError", "generate"]  # generation
__all__ += ["context_parallel"]  # long sequences
