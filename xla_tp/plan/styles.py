"""xla_tp's own style: parameter specs and activation chains given directly.

For what torch's styles cannot say: GPT-2's ``Conv1D`` (weight ``[in, out]``), packed q/k/v
projections, ``nn.MultiheadAttention``'s ``in_proj_weight``, a norm sharded over its features.
The axis name ``"tp"`` stands for the tensor-parallel axis of the mesh it is applied on.
Example::

    # GPT-2 Conv1D, column-parallel: weight [in, out] sharded on dim 1, bias on dim 0
    ShardParams({"weight": (None, "tp"), "bias": ("tp",)}, outputs=((Shard(-1),),))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from torch import nn
from torch.distributed.tensor.placement_types import Placement

from ..errors import PlanError
from .layout import Chain, ModuleLayout

TP = "tp"


@dataclass(frozen=True)
class ShardParams:
    """Shard named parameters of one module; optionally constrain its inputs and outputs."""

    params: Mapping[str, tuple[Optional[str], ...]] = field(default_factory=dict)
    inputs: tuple[Chain, ...] = ()
    outputs: tuple[Chain, ...] = ()
    kwarg_inputs: Mapping[str, Chain] = field(default_factory=dict)
    natural_output: Optional[Placement] = None  # Partial() for a row-parallel module (see ModuleLayout)

    def lower(self, fqn: str, module: nn.Module, key: str, tp_axis: str) -> ModuleLayout:
        own = dict(module.named_parameters(recurse=True))
        missing = [n for n in self.params if n not in own]
        if missing:
            raise PlanError(f"plan key {key!r}: module {fqn!r} ({type(module).__name__}) has no "
                            f"parameters {missing}; it has {sorted(own)}")
        params = {n: tuple(tp_axis if a == TP else a for a in spec) for n, spec in self.params.items()}
        return ModuleLayout(fqn=fqn, source=key, style=repr(self), params=params, inputs=self.inputs,
                            kwarg_inputs=dict(self.kwarg_inputs), outputs=self.outputs,
                            natural_output=self.natural_output)
