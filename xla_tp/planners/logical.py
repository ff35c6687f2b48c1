"""``LogicalStyle``: the style of every "auto" plan, its parameters' dimensions named by logical axis.

A planner says what each parameter dimension *is* (``vocab``, ``heads``, ``mlp``, ``embed``); the
table ``xla_tp.axes.LOGICAL_AXES`` says which mesh axes each of those is split over. ``embed`` stays
whole on the model axis: on an ``fsdp`` mesh axis the layout shards each parameter's first free
dimension over ``fsdp`` afterwards (``param_shard`` in the table, ``plan.normalize``). Example:

>>> style = LogicalStyle({"weight": ("heads", "embed")}, role="column-parallel")
>>> style.lower("layers.0.wq", nn.Linear(64, 64), "layers.*.wq", "model").params
{'weight': ('model', None)}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from torch import nn
from torch.distributed.tensor.placement_types import Placement

from ..axes import TP, mesh_axes, spec_entry
from ..plan.layout import Chain, ModuleLayout
from ..plan.styles import ShardParams, Style
from ..plan.subaxis import split_sub_axis, sub_axis


def mesh_axis(logical: Optional[str]) -> object:
    """The spec entry of a parameter dimension: ``mesh_axis("heads") == "tp"`` (the tensor-parallel
    axis, whatever its name); ``mesh_axis("heads@4") == "tp@4"`` (a sub-axis: ``plan.subaxis``);
    ``mesh_axis("embed") is None``; unknown names are an error."""
    base, size = split_sub_axis(logical) if logical is not None else (None, None)
    axes = mesh_axes(base, tp_axis=TP)
    return spec_entry(axes if size is None else tuple(sub_axis(a, size) for a in axes))


def _named(entry: object, tp_axis: str) -> object:
    """``TP``'s sub-axes named after the call's tensor-parallel axis (``ShardParams`` names ``TP`` itself)."""
    if not isinstance(entry, str):
        return entry
    base, size = split_sub_axis(entry)
    return sub_axis(tp_axis, size) if base == TP and size is not None else entry


@dataclass(frozen=True)
class LogicalStyle(Style):
    """Per-parameter logical axes, lowered through ``LOGICAL_AXES``; ``role`` labels explanations."""

    params: Mapping[str, tuple[Optional[str], ...]] = field(default_factory=dict)
    role: str = ""
    natural_output: Optional[Placement] = None  # Partial() for a row-parallel module (see ModuleLayout)
    outputs: tuple[Chain, ...] = ()  # output constraints (an output head keeps its logits split)
    input_grad: bool = False  # an MoE experts layer's (see ModuleLayout)
    inputs: tuple[Chain, ...] = ()  # input constraints (a row-parallel projection alone holds its input whole)

    def lower(self, fqn: str, module: nn.Module, key: str, tp_axis: str) -> ModuleLayout:
        specs = {n: tuple(_named(mesh_axis(a), tp_axis) for a in axes) for n, axes in self.params.items()}
        ml = ShardParams(specs, inputs=self.inputs, outputs=self.outputs, natural_output=self.natural_output,
                         input_grad=self.input_grad).lower(fqn, module, key, tp_axis)
        ml.style = self.role or repr(self)
        return ml

    def __repr__(self) -> str:
        return f"LogicalStyle({self.role}: {dict(self.params)})"
