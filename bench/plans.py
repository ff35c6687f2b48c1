"""The ways of applying a plan the bench compares, all reading the plan through xla_tp's front-ends.

``hand_apply`` is what people write today on XLA: one ``xs.mark_sharding`` per weight, with the specs
the plan means (``xla_tp.plan``'s lowering of HF strings and styles) and nothing else: no activation
constraints, no attention lowering. ``to_torch_plan`` turns an HF-style plan into torch styles for
torch's own ``parallelize_module`` (route d), from the meanings in ``xla_tp.plan.hf``. Example::

    plan = xla_tp.hf_plan(model)      # {"model.layers.*.self_attn.q_proj": "colwise", ...}
    hand_apply(model.to(xla), plan, mesh)
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Replicate

from xla_tp.plan.hf import HF_STYLES, colwise_spec, rowwise_spec
from xla_tp.plan.layout import Layout
from xla_tp.plan.match import match_keys
from xla_tp.plan.normalize import build_layout


def plan_layout(model: nn.Module, plan: dict[str, Any], mesh: Any) -> Layout:
    """The normalised layout of ``plan`` on ``model`` (keys that match nothing are skipped)."""
    sizes = {str(n): int(s) for n, s in zip(mesh.axis_names, mesh.mesh_shape)}
    return build_layout(model, plan, sizes, "model", strict=False)


def hand_apply(model: nn.Module, plan: dict[str, Any], mesh: Any) -> nn.Module:
    """``xs.mark_sharding`` on each planned weight, as a user would write by hand (model on XLA)."""
    import torch_xla.distributed.spmd as xs
    for name, spec in plan_layout(model, plan, mesh).params.items():
        xs.mark_sharding(model.get_parameter(name), mesh, spec)
    return model


def to_torch_plan(plan: dict[str, Any], model: nn.Module) -> dict[str, ParallelStyle]:
    """Torch styles for the Linear/Embedding modules of an HF-style plan (other entries are dropped)."""
    found, _ = match_keys(list(plan), [fqn for fqn, _ in model.named_modules()])
    out: dict[str, ParallelStyle] = {}
    for fqn, key in found.items():
        style = HF_STYLES.get(plan[key]) if isinstance(plan[key], str) else None
        if style is None or not isinstance(model.get_submodule(fqn), (nn.Linear, nn.Embedding)):
            continue
        if style.params is colwise_spec:
            out[fqn] = ColwiseParallel(output_layouts=Replicate()) if Replicate() in style.outputs else ColwiseParallel()
        elif style.params is rowwise_spec:
            out[fqn] = RowwiseParallel()
    return out
